"""GLM-4-9B-Chat's fixed facts: special tokens, stop tokens, chat template, dtype.

Everything here holds for both checkpoints (``THUDM/glm-4-9b-chat`` and
``THUDM/glm-4-9b-chat-hf``). Token ids are looked up by name in the served
tokenizer, so the tiny test model (whose ids are small) follows the same path
as the real one (whose ids are in :data:`REAL_STOP_TOKEN_IDS`).

Runs in each model replica, in each ReplicaPicker replica (the chat template it routes by) and in
the application's build (the config's checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
"""In the order, and so the relative ids, of the real tokenizer."""

STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
"""Any of these ends an answer: the end of text, the user's turn, or a tool's result."""

REAL_STOP_TOKEN_IDS = {"<|endoftext|>": 151329, "<|user|>": 151336, "<|observation|>": 151338}
"""Their ids in the real GLM-4 tokenizer (``[gMASK]`` is 151331, ``<sop>`` 151333)."""

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
_MARKED_CONTROL = "{{ '\\ufdd0' ~ token }}"


def plain_chat_template() -> str:
    """The chat template without control-token marks, for a checkpoint's own tokenizer config.

    Other servers (bare vLLM in the side-by-side benchmark) render a checkpoint's
    template and tokenize it themselves; the marks are for this app's replicas only
    (:mod:`serve_app.glm4.control_tokens`).
    """
    template = CHAT_TEMPLATE_PATH.read_text()
    assert _MARKED_CONTROL in template, "the chat template's control() macro changed"
    return template.replace(_MARKED_CONTROL, "{{ token }}")


HALF_PRECISION = frozenset({"half", "float16", "fp16"})
REFUSED_DTYPE_REASON = (
    "GLM-4-9B-Chat's weights are bfloat16 and its activations overflow float16, "
    "which turns its output into NaN garbage; use dtype bfloat16 (or float32)"
)


class Vocabulary(Protocol):
    def get_vocab(self) -> dict[str, int]: ...


def stop_token_ids(tokenizer: Vocabulary) -> list[int]:
    """The served tokenizer's ids of :data:`STOP_TOKENS`; fails if one is missing."""
    vocab = tokenizer.get_vocab()
    missing = [token for token in STOP_TOKENS if token not in vocab]
    if missing:
        raise ValueError(
            f"the tokenizer has no {', '.join(missing)}: it is not a GLM-4 tokenizer, "
            "and GLM-4-9B-Chat would never stop generating without these stop tokens"
        )
    return [vocab[token] for token in STOP_TOKENS]


def check_dtype(dtype: Any) -> None:
    """Refuse half precision, whether named in a config or resolved by vLLM to a torch dtype."""
    name = str(dtype).removeprefix("torch.").lower()
    if name in HALF_PRECISION:
        raise ValueError(f"dtype {name} refused: {REFUSED_DTYPE_REASON}")
