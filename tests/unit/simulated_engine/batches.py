"""Driving the simulated engine's batch by hand: a small vocabulary, sequences, a clock run to the end."""

from __future__ import annotations

import random
from typing import Any

from serve_app.simulated_engine.batch import ContinuousBatch, Emitted, SimSequence
from serve_app.simulated_engine.timing import GpuTiming

VOCABULARY = list(range(10, 60))
EOS = 99  # outside the vocabulary, as a tokenizer's special tokens are


def timing(capacity: int = 10_000, budget: int = 1000) -> GpuTiming:
    """Round figures: 10 ms per step, 1 ms per 1000 context tokens, 0.1 ms per prompt token."""
    return GpuTiming(
        step_overhead_s=0.010,
        kv_bytes_per_token=1000,
        memory_bandwidth_bytes_s=1e9,
        prefill_s_per_token=0.0001,
        kv_capacity_tokens=capacity,
        max_num_batched_tokens=budget,
    )


def sequence(
    request_id: str, prompt: int = 10, max_tokens: int = 5, arrival_s: float = 0.0, **overrides: Any
) -> SimSequence:
    fields: dict[str, Any] = dict(
        request_id=request_id,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        max_model_len=100_000,
        min_tokens=0,
        stop_token=EOS,
        stop_reason=None,
        avoid=frozenset(),
        rng=random.Random(request_id),
        arrival_s=arrival_s,
    )
    return SimSequence(**(fields | overrides))


def run(batch: ContinuousBatch, start_s: float = 0.0, max_steps: int = 10_000) -> list[tuple[float, Emitted]]:
    """Steps back to back until nothing is left: every token with the time its step ended."""
    now = start_s
    tokens: list[tuple[float, Emitted]] = []
    for _ in range(max_steps):
        if batch.idle:
            return tokens
        step = batch.schedule(now)
        assert step is not None, "work is left, but no step runs"
        now = step.end_s
        tokens += [(now, emitted) for emitted in batch.complete(step)]
    raise AssertionError("the batch did not drain")


def by_request(tokens: list[tuple[float, Emitted]]) -> dict[str, list[Emitted]]:
    out: dict[str, list[Emitted]] = {}
    for _, emitted in tokens:
        out.setdefault(emitted.sequence.request_id, []).append(emitted)
    return out


# --- the timing model ---
