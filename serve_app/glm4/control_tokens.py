"""Chat prompts in which only the chat template's own markers are GLM-4 control tokens.

A tokenizer turns every special-token string in its input into the special
token, wherever the string came from. A user message or a tool result holding
``<|observation|>`` or ``<|user|>`` would therefore forge a turn of the
conversation, or ``<|endoftext|>`` end the prompt. So GLM-4's chat template
writes each control token it means as :data:`CONTROL_MARK` followed by the
token's string, and :class:`PromptTokenizer` tokenizes a rendered prompt in
pieces: a marked string becomes its control token, everything else (which is
all the client's text, and the template's plain text) is tokenized as text, so
a special-token string there becomes ordinary tokens that read back as the
same string.

The mark is U+FDD0, a Unicode noncharacter (reserved for a program's internal
use): concatenating client strings cannot form it, and a request carrying it
is refused (:func:`find_control_mark`), so clients cannot forge a mark either.
This module is pure (a tokenizer in, token ids out); :mod:`serve_app.glm4.serving`
puts it in vLLM's chat rendering.

Runs in each model replica (the front door's checks, vLLM's grammars).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.glm4.format import SPECIAL_TOKENS

CONTROL_MARK = "\ufdd0"
"""Written by the chat template before each control token it means (a Unicode noncharacter)."""


class TextTokenizer(Protocol):
    """What :class:`PromptTokenizer` needs of a Hugging Face tokenizer (fast or slow)."""

    def get_vocab(self) -> dict[str, int]: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


class ControlTokenInText(ValueError):
    """The tokenizer made a control token of text: it cannot tokenize client text safely."""


@dataclass(frozen=True)
class PromptTokens:
    """A rendered chat prompt: its token ids, and its text without marks."""

    token_ids: list[int]
    text: str


class PromptTokenizer:
    """Tokenizes prompts rendered by GLM-4's chat template (see the module docstring).

    Built once per replica; it checks on construction that the tokenizer can
    tokenize every special-token string as text, and refuses one that cannot.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        vocab = tokenizer.get_vocab()
        self._tokenizer = tokenizer
        self.control_ids = {token: vocab[token] for token in SPECIAL_TOKENS if token in vocab}
        self._ids = frozenset(self.control_ids.values())
        alternatives = "|".join(re.escape(t) for t in sorted(self.control_ids, key=len, reverse=True))
        self._marked = re.compile(f"{CONTROL_MARK}({alternatives})")
        for token in self.control_ids:
            self.text_ids(f"a{token}b")  # raises if this tokenizer cannot

    def text_ids(self, text: str) -> list[int]:
        """``text`` as ordinary tokens: a special-token string in it is not a control token."""
        ids = self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if not self._ids.isdisjoint(ids):
            raise ControlTokenInText(
                "the tokenizer turned text into a GLM-4 control token even with split_special_tokens; "
                "client text could forge turns, so it is not used"
            )
        return ids

    def tokenize(self, rendered: str) -> PromptTokens:
        """Token ids of a prompt the chat template rendered; only marked strings are control tokens."""
        pieces = self._marked.split(rendered)
        token_ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # the control token a mark named
                token_ids.append(self.control_ids[piece])
            elif piece:
                if CONTROL_MARK in piece:
                    raise ValueError(f"the chat template marked something that is not a control token: {piece!r}")
                token_ids.extend(self.text_ids(piece))
        return PromptTokens(token_ids, "".join(pieces))


def find_control_mark(value: Any, where: str = "") -> str | None:
    """The path (``messages[0].content``) of a string in a JSON-like value that holds
    :data:`CONTROL_MARK`, keys included; None when there is none."""
    if isinstance(value, str):
        return (where or "(value)") if CONTROL_MARK in value else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            found = find_control_mark(key, path) or find_control_mark(item, path)
            if found:
                return found
        return None
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        for index, item in enumerate(value):
            found = find_control_mark(item, f"{where}[{index}]")
            if found:
                return found
    return None


MARK_REFUSED = "contains U+FDD0, a Unicode noncharacter this server reserves for marking GLM-4's control tokens"
