"""What building a request's grammar costs: specs at ``ingress.max_grammar_chars``, and small specs
whose work grows with a number in them (what ``ingress.max_grammar_build_s`` stops).

Each spec is built three ways, timed: as the ingress's checker process builds it first
(:func:`serve_app.vllm_internals.build_request_grammar`: vLLM's validation, then the engine's
matcher with a tokenizer of bytes), as the replica's front end validates it on its event loop
(vLLM's ``validate_guidance_grammar`` with llguidance's tokenizer), and as the engine compiles
it (vLLM's ``GuidanceBackend``) and fills the first token mask. Then the checker process itself
is started ``--checker-starts`` times: how long a start and its first build take (what requests
wait for after a kill), and a build once it is warm. GLM-4's tokenizer is stood in
for as in :mod:`benchmarks.grammar_cost`.

Run from the repository root: ``.venv/bin/python -m benchmarks.grammar_build``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.grammar_cost import GLM4_VOCAB, backend, stand_in_tokenizer
from serve_app.front_door.admission.request_cost import grammar_specs

BOUND = 32_768  # ingress.max_grammar_chars


def deep_refs(levels: int) -> dict[str, Any]:
    """Objects of two properties each naming the level below: a tree as deep as ``levels``, written once."""
    defs: dict[str, Any] = {"l0": {"type": "string"}}
    for i in range(1, levels):
        child = {"$ref": f"#/$defs/l{i - 1}"}
        defs[f"l{i}"] = {"type": "object", "properties": {"a": child, "b": child}, "required": ["a", "b"]}
    return {"$defs": defs, "$ref": f"#/$defs/l{levels - 1}"}


def size(spec: dict[str, Any]) -> int:
    """Characters of ``structured_outputs`` as the ingress counts them against :data:`BOUND`."""
    return grammar_specs({"structured_outputs": spec})["structured_outputs"]


def fill(make: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """``make(n)`` with the largest ``n`` whose :func:`size` stays within :data:`BOUND`."""
    n = 1
    while size(make(n * 2)) <= BOUND:
        n *= 2
    step = n // 2
    while step:
        if size(make(n + step)) <= BOUND:
            n += step
        step //= 2
    return make(n)


def lark_rules(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "t{i}" r{i + 1} | "u{i}"\n' for i in range(n)) + f'r{n}: "end"\n'


def at_the_bound() -> dict[str, dict[str, Any]]:
    """``structured_outputs`` of up to :data:`BOUND` characters, of shapes that cost llguidance the most here."""
    return {
        "properties with patterns": fill(
            lambda n: {
                "json": {
                    "type": "object",
                    "properties": {
                        f"p{i}": {"type": "string", "pattern": f"[a-z]{{1,{i % 50 + 9}}}x{i}"} for i in range(n)
                    },
                    "required": [f"p{i}" for i in range(n)],
                }
            }
        ),
        "anyOf of objects": fill(
            lambda n: {
                "json": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {f"k{i}": {"type": "integer", "maximum": i}},
                            "required": [f"k{i}"],
                        }
                        for i in range(n)
                    ]
                }
            }
        ),
        "enum": fill(lambda n: {"json": {"type": "string", "enum": [f"value-{i:06d}" for i in range(n)]}}),
        "$defs tree": fill(lambda n: {"json": deep_refs(n)}),
        "Lark rules": fill(lambda n: {"grammar": lark_rules(n)}),
        "regex alternation": fill(lambda n: {"regex": "(" + "|".join(f"w{i}z" for i in range(n)) + ")"}),
    }


def growing(count: int) -> dict[str, dict[str, Any]]:
    """Specs of under 60 characters whose build grows with ``count``."""
    return {
        f"array, minItems {count:,}": {"json": {"type": "array", "minItems": count}},
        f"array, maxItems {count:,}": {"json": {"type": "array", "maxItems": count}},
    }


def timed(build: Callable[[], Any]) -> str:
    """Milliseconds ``build`` took, and whether it refused the spec (raised, or returned an error)."""
    started = time.perf_counter()
    try:
        refused = isinstance(build(), str)
    except Exception:  # noqa: BLE001 - vLLM's refusal (a 400 to the client), reported as such
        refused = True
    return f"{(time.perf_counter() - started) * 1e3:.1f}" + (" (refused)" if refused else "")


def costs(spec: dict[str, Any], ll_tokenizer: Any, engine: Any) -> tuple[str, str, str]:
    """Milliseconds to build ``spec`` (``structured_outputs``) in the checker, the front end and the engine."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    from serve_app.vllm_internals import build_request_grammar

    request = CompletionRequest(model="m", prompt="p", structured_outputs=spec)
    checker = timed(lambda: build_request_grammar(request))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    front_end = timed(lambda: validate_guidance_grammar(params, tokenizer=ll_tokenizer))
    ((kind, value),) = spec.items()
    option = {"json": StructuredOutputOptions.JSON, "grammar": StructuredOutputOptions.GRAMMAR}.get(
        kind, StructuredOutputOptions.REGEX
    )
    text = json.dumps(value) if kind == "json" else value
    bitmask = engine.allocate_token_bitmask(1)
    engine_s = timed(lambda: engine.compile_grammar(option, text).fill_bitmask(bitmask, 0))
    return checker, front_end, engine_s


async def checker_starts(starts: int) -> list[tuple[float, float]]:
    """Seconds for a new checker process to start and build a ``json_object`` grammar, then to build another."""
    import pickle

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from serve_app.front_door.admission.large_bodies import BodyChecker

    request = pickle.dumps(CompletionRequest(model="m", prompt="p", response_format={"type": "json_object"}))
    times = []
    for _ in range(starts):
        checker = BodyChecker()
        try:
            started = time.perf_counter()
            await checker.build_grammar(request, 60, "response_format")
            first = time.perf_counter() - started
            started = time.perf_counter()
            await checker.build_grammar(request, 60, "response_format")
            times.append((first, time.perf_counter() - started))
        finally:
            checker.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("models/bpe-151k"))
    parser.add_argument("--corpus-mb", type=int, default=64, help="local text to train the stand-in on")
    parser.add_argument("--counts", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--checker-starts", type=int, default=3)
    args = parser.parse_args()
    import vllm.sampling_params

    from serve_app.glm4 import vllm_plugin

    tokenizer = stand_in_tokenizer(args.tokenizer_dir, GLM4_VOCAB, args.corpus_mb << 20)
    vllm_plugin.register()
    ll_tokenizer = vllm.sampling_params._get_llg_tokenizer(tokenizer)
    engine = backend("guidance", tokenizer)
    specs = at_the_bound()
    for count in args.counts:
        specs |= growing(count)
    print(f"vocabulary: {len(tokenizer)} tokens")
    print("| spec | characters | checker (ms) | front end (ms) | engine, with the first mask (ms) |")
    print("|---|---|---|---|---|")
    for name, spec in specs.items():
        checker, front_end, engine_s = costs(spec, ll_tokenizer, engine)
        print(f"| {name} | {size(spec):,} | {checker} | {front_end} | {engine_s} |", flush=True)
    for first, warm in asyncio.run(checker_starts(args.checker_starts)):
        print(f"checker process: started and built its first grammar in {first:.2f} s; the next in {warm * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
