"""Generate a tiny random-weight model with GLM-4-9B-Chat's architecture.

The real checkpoint cannot be downloaded everywhere (CI, laptops, air-gapped
boxes), yet tests must drive the *real* vLLM engine. This writes a checkpoint
that vLLM loads through the same code path as ``THUDM/glm-4-9b-chat-hf``:
``GlmForCausalLM`` with head_dim 128, partial rotary embeddings, attention bias,
grouped-query attention, GLM-4's special tokens and chat format. The weights
are random, so its text is noise: assert on token counts, finish reasons and
protocol shape, never on words.

Usage: ``python -m tools.tiny_model OUT_DIR``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serve_app.glm4.format import SPECIAL_TOKENS, STOP_TOKENS, plain_chat_template

BASE_VOCAB_SIZE = 350

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? I am an assistant.",
    "What is the weather like in Beijing, Shanghai and Paris?",
    "Write a short poem about the sea, the sky and the stars.",
    "def main():\n    print('hello world')\n    return 0\n",
    '{"city": "Beijing", "unit": "celsius", "days": 3}',
    "get_weather search_web calculator translate summarize",
    "You are a helpful assistant. Answer the user's question concisely.",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"",
]


def build_tokenizer():
    """A byte-level BPE tokenizer of ~350 tokens plus GLM-4's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=plain_chat_template(),
        model_max_length=8192,
        padding_side="left",
    )


def generate(out_dir: Path, seed: int = 0) -> Path:
    """Write the tokenizer, config, generation config and bf16 random weights."""
    import torch
    from transformers import GlmConfig, GlmForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    vocab_size = ((len(tokenizer) + 63) // 64) * 64  # padded, like the real 151552
    config = GlmConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        partial_rotary_factor=0.5,
        attention_bias=True,
        max_position_embeddings=8192,
        rms_norm_eps=1.5625e-07,
        rope_theta=10000.0,
        pad_token_id=stop_ids[0],
        # Only <|endoftext|>, as in checkpoints whose configs lost the other two:
        # the server must stop on all three regardless (see serve_app.glm4).
        eos_token_id=stop_ids[0],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = GlmForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = stop_ids[0]
    model.generation_config.pad_token_id = stop_ids[0]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "tiny_model.json").write_text(json.dumps({"generator": "tools.tiny_model", "seed": seed}) + "\n")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="regenerate if present")
    args = parser.parse_args()
    if (args.out_dir / "tiny_model.json").exists() and not args.force:
        print(f"tiny model already at {args.out_dir}")
        return
    print(f"tiny GLM-4 model written to {generate(args.out_dir, args.seed)}")


if __name__ == "__main__":
    main()
