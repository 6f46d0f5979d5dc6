"""What decoding under a JSON schema costs per token, with llguidance (the app's) and xgrammar.

vLLM fills each structured request's token mask on the host, in the engine-core process,
once per decoding step; on a GPU that CPU time sits between steps. This times what vLLM's
own backend classes do for one request: compiling the schema, then, per token, filling
the mask and accepting the token, along seeded random walks that take any allowed token
(the tests' schemas, tests/json_schemas.py). The cost grows with the vocabulary, and
GLM-4's tokenizer (151,552 tokens) cannot be downloaded here, so a byte-level BPE of the
same size is trained on local text as its stand-in (kept in ``--tokenizer-dir``).

Run from the repository root: ``.venv/bin/python -m benchmarks.grammar_cost``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.json_schemas import SCHEMAS

GLM4_VOCAB = 151_552
BACKENDS = ("guidance", "xgrammar")


def local_text(limit_bytes: int) -> Iterator[str]:
    """Python sources of the installed packages, up to ``limit_bytes``: plenty of words and code."""
    seen = 0
    for path in sorted(Path(sys.prefix, "lib").rglob("*.py")):
        text = path.read_text(errors="replace")
        yield text
        seen += len(text)
        if seen >= limit_bytes:
            return


def stand_in_tokenizer(directory: Path, vocab_size: int, corpus_bytes: int) -> Any:
    """A byte-level BPE with GLM-4's vocabulary size, trained once and kept in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not (directory / "tokenizer.json").exists():
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(local_text(corpus_bytes), trainer=trainer)
        directory.mkdir(parents=True, exist_ok=True)
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return PreTrainedTokenizerFast.from_pretrained(directory)


def backend(name: str, tokenizer: Any) -> Any:
    """vLLM's backend class, configured as the serve configs configure the engine."""
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from serve_app.glm4 import vllm_plugin

    vllm_plugin.register()  # the app's vLLM plugin, as in its engines
    settings = types.SimpleNamespace(disable_any_whitespace=True, disable_additional_properties=name == "guidance")
    vllm_config = types.SimpleNamespace(structured_outputs_config=settings, model_config=None, speculative_config=None)
    backend_class = {"guidance": GuidanceBackend, "xgrammar": XgrammarBackend}[name]
    return backend_class(vllm_config, tokenizer=tokenizer, vocab_size=len(tokenizer))


@dataclass
class Walk:
    """One random walk under a grammar: the tokens it took and what each step cost."""

    tokens: list[int]
    ended: bool  # the grammar let it end (else it was still going after ``longest`` tokens)
    compile_s: float
    step_s: list[float]  # per token: filling the mask, and accepting the token


def allowed_tokens(bitmask: Any, vocab_size: int) -> np.ndarray:
    """The token ids the first row of a filled bitmask allows."""
    allowed = np.flatnonzero(np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little"))
    return allowed[allowed < vocab_size]


def walk(backend: Any, schema: dict | None, seed: int, eos: int, longest: int) -> Walk:
    """Compile ``schema`` (None: ``json_object``), then take any allowed token, seeded, until it may end."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    rng = random.Random(seed)
    started = time.perf_counter()
    if schema is None:
        grammar = backend.compile_grammar(StructuredOutputOptions.JSON_OBJECT, "")
    else:
        grammar = backend.compile_grammar(StructuredOutputOptions.JSON, json.dumps(schema))
    done = Walk([], False, time.perf_counter() - started, [])
    bitmask = backend.allocate_token_bitmask(1)
    for _ in range(longest):
        started = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        mask_s = time.perf_counter() - started
        token = int(rng.choice(allowed_tokens(bitmask, backend.vocab_size)))
        if token == eos:
            done.step_s.append(mask_s)
            done.ended = True
            return done
        started = time.perf_counter()
        if not grammar.accept_tokens("walk", [token]):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
        done.step_s.append(mask_s + time.perf_counter() - started)
        done.tokens.append(token)
        if grammar.is_terminated():
            done.ended = True
            return done
    return done


def measure(name: str, tokenizer: Any, walks: int, longest: int) -> dict[str, float]:
    engine = backend(name, tokenizer)
    compiles, steps = [], []
    for schema_name, schema in SCHEMAS.items():
        for seed in range(walks):
            # A new schema text each walk, so no compile is served from a cache.
            fresh = schema | {"title": f"{schema_name}-{seed}"}
            done = walk(engine, fresh, seed, tokenizer.eos_token_id, longest)
            compiles.append(done.compile_s)
            steps.extend(done.step_s)
    quantiles = statistics.quantiles(steps, n=100)
    return {
        "compile_ms_p50": statistics.median(compiles) * 1e3,
        "compile_ms_max": max(compiles) * 1e3,
        "token_us_p50": quantiles[49] * 1e6,
        "token_us_p99": quantiles[98] * 1e6,
        "token_us_mean": statistics.fmean(steps) * 1e6,
        "tokens": len(steps),
    }


def validation_cost(tokenizer: Any, repeats: int = 20) -> tuple[float, float]:
    """The front end's side: (seconds to build its llguidance tokenizer, seconds to validate one schema)."""
    import vllm.sampling_params
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar

    from serve_app.glm4 import vllm_plugin

    vllm_plugin.register()
    started = time.perf_counter()
    ll_tokenizer = vllm.sampling_params._get_llg_tokenizer(tokenizer)
    built = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeats):
        for schema in SCHEMAS.values():
            params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
            validate_guidance_grammar(params, tokenizer=ll_tokenizer)
    return built, (time.perf_counter() - started) / (repeats * len(SCHEMAS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("models/bpe-151k"))
    parser.add_argument("--corpus-mb", type=int, default=64, help="local text to train the stand-in on")
    parser.add_argument("--walks", type=int, default=5, help="random walks per schema")
    parser.add_argument("--longest", type=int, default=200, help="tokens per walk at most")
    args = parser.parse_args()
    tokenizer = stand_in_tokenizer(args.tokenizer_dir, GLM4_VOCAB, args.corpus_mb << 20)
    print(f"vocabulary: {len(tokenizer)} tokens; {len(SCHEMAS)} schemas x {args.walks} walks")
    built, validated = validation_cost(tokenizer)
    print(f"front end (llguidance): tokenizer built in {built:.2f} s; a schema validated in {validated * 1e3:.2f} ms")
    print("backend    compile p50 / max (ms)   per token p50 / p99 / mean (µs)   tokens")
    for name in BACKENDS:
        r = measure(name, tokenizer, args.walks, args.longest)
        print(
            f"{name:10} {r['compile_ms_p50']:8.1f} / {r['compile_ms_max']:7.1f}"
            f"        {r['token_us_p50']:7.1f} / {r['token_us_p99']:7.1f} / {r['token_us_mean']:7.1f}   {r['tokens']:6}"
        )


if __name__ == "__main__":
    main()
