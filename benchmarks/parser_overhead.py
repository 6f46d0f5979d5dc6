"""What reading GLM-4 answers adds per streamed token, on this CPU.

Every chat stream passes each delta through ``Glm4Parser.parse_delta``; this
times it on a 2,250-character answer fed one character at a time (best of 5).
Run from the repository root: ``.venv/bin/python -m benchmarks.parser_overhead``
"""

from __future__ import annotations

import time

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from serve_app.glm4.parser import Glm4Parser

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ANSWER = "\n" + "The quick brown fox jumps over the lazy dog. " * 50
CASES = {"no tools": {}, "tools offered, text answer": {"tools": [TOOL]}}


def per_delta_seconds(extra: dict, repeats: int = 5) -> float:
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True, **extra)
    best = float("inf")
    for _ in range(repeats):
        parser = Glm4Parser(None, request.tools)
        start = time.perf_counter()
        for i, char in enumerate(ANSWER):
            parser.parse_delta(char, [0], request, finished=i == len(ANSWER) - 1)
        best = min(best, (time.perf_counter() - start) / len(ANSWER))
    return best


def baseline_seconds(repeats: int = 5) -> float:
    """What vLLM does per delta when no parser is configured: wrap it in a DeltaMessage."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for char in ANSWER:
            DeltaMessage(content=char)
        best = min(best, (time.perf_counter() - start) / len(ANSWER))
    return best


def main() -> None:
    print(f"vLLM without a parser (baseline): {baseline_seconds() * 1e6:.1f} µs per streamed delta")
    for label, extra in CASES.items():
        print(f"{label}: {per_delta_seconds(extra) * 1e6:.1f} µs per streamed delta")


if __name__ == "__main__":
    main()
