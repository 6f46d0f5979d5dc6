"""The simulated engine's timing model and continuous batching (pure logic, on a clock the test drives)."""

from __future__ import annotations

import math
import random

import pytest

from serve_app.config import ModelConfig, SimulatedEngineConfig
from serve_app.glm4 import sizing
from serve_app.simulated_engine.batch import ContinuousBatch, Event, Finish
from serve_app.simulated_engine.timing import GpuTiming
from tests.unit.simulated_engine.batches import EOS, VOCABULARY, by_request, run, sequence, timing


def test_the_default_timing_is_glm4_9b_on_one_h100():
    h100 = GpuTiming.from_config(SimulatedEngineConfig())
    # (80 GB x 0.9 - 18.8 GB of weights) / 40 KiB per token
    assert h100.kv_capacity_tokens == int((80 * 0.9 - sizing.weights_gb()) * 1e9 // 40960) == 1_298_855
    # 1.4 ms of launch and sampling, and 18.8 GB of weights read at 3.35 TB/s.
    step = 0.0014 + sizing.weights_gb() * 1e9 / 3.35e12
    assert h100.step_s(0, 0) == pytest.approx(step) == pytest.approx(0.007, abs=2e-5)
    # 64 sequences of 1000 tokens: 64,000 x 40 KiB read at 3.35 TB/s adds 0.78 ms.
    assert h100.step_s(64_000, 0) == pytest.approx(step + 64_000 * 40960 / 3.35e12)
    # A 1000-token prompt: 31 ms of compute.
    assert h100.step_s(1000, 1000) - h100.step_s(1000, 0) == pytest.approx(0.031)
    assert h100.decode_tokens_per_s(64, 288) == pytest.approx(64 / h100.step_s(64 * 288, 0))


def test_fp8_weights_and_kv_cache_shorten_each_step_and_double_the_tokens_that_fit():
    """The sizes follow vLLM's engine arguments (quantization, kv_cache_dtype) unless set."""

    def timing(**engine_args) -> GpuTiming:
        config = ModelConfig(
            name="m",
            engine_args={"model": "m", "max_num_seqs": 8, **engine_args},
            simulated_engine=SimulatedEngineConfig(),
        )
        assert config.simulated_engine is not None
        return GpuTiming.from_config(config.simulated_engine)

    bf16, fp8 = timing(), timing(quantization="fp8", kv_cache_dtype="fp8")
    assert bf16 == GpuTiming.from_config(SimulatedEngineConfig())
    assert fp8.kv_bytes_per_token == 20480 and bf16.kv_bytes_per_token == 40960
    # Weights: 8.16 B linear parameters at 1 byte, the 1.24 B of the vocabulary's two matrices at 2.
    assert fp8.step_s(0, 0) == pytest.approx(0.0014 + (8.158e9 + 2 * 1.2415e9) / 3.35e12, rel=1e-4)
    assert fp8.kv_capacity_tokens == int((72e9 - sizing.weights_gb("fp8") * 1e9) // 20480)
    assert fp8.kv_capacity_tokens > 2 * bf16.kv_capacity_tokens  # (the smaller weights leave more room too)
    assert timing(quantization="awq").step_s(0, 0) < fp8.step_s(0, 0)
    explicit = ModelConfig(
        name="m",
        engine_args={"model": "m", "max_num_seqs": 8, "quantization": "fp8"},
        simulated_engine=SimulatedEngineConfig(weights_gb=12.0),
    )
    assert explicit.simulated_engine is not None and explicit.simulated_engine.weights_gb == 12.0
    with pytest.raises(ValueError, match="no size known for quantization 'bitsandbytes'"):
        timing(quantization="bitsandbytes")


def test_every_figure_is_a_setting():
    custom = GpuTiming.from_config(
        SimulatedEngineConfig(
            gpu_memory_gb=40,
            gpu_memory_utilization=0.5,
            weights_gb=10,
            kv_bytes_per_token=10_000,
            memory_bandwidth_tb_s=1,
            step_launch_ms=2,
            prefill_ms_per_token=0.5,
            max_num_batched_tokens=100,
        )
    )
    assert custom.kv_capacity_tokens == 1_000_000
    assert custom.step_s(100, 10) == pytest.approx(0.002 + (10e9 + 100 * 10_000) / 1e12 + 10 * 0.0005)
    assert custom.max_num_batched_tokens == 100


# --- continuous batching ---


def test_a_sequence_prefills_then_decodes_one_token_per_step_to_max_tokens():
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY)
    batch.add(sequence("a", prompt=10, max_tokens=5))
    tokens = run(batch)
    assert [e.finish for _, e in tokens] == [None, None, None, None, Finish.LENGTH]
    times = [t for t, _ in tokens]
    # Prefill: 10 ms + 10 tokens of KV + 10 prompt tokens; then one decode step per token.
    assert times[0] == pytest.approx(0.010 + 10 * 1e-6 + 10 * 1e-4)
    assert times[1] - times[0] == pytest.approx(0.010 + 11 * 1e-6)
    assert batch.kv_used_tokens == 0


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    batch = ContinuousBatch(timing(budget=40), max_num_seqs=4, vocabulary=VOCABULARY)
    batch.add(sequence("a", prompt=100, max_tokens=1))
    steps = []
    while not batch.idle:
        step = batch.schedule(0.0)
        assert step is not None
        steps.append((step.sequences[0].scheduled_tokens, len(batch.complete(step))))
    assert steps == [(40, 0), (40, 0), (20, 1)]


def test_decoding_sequences_share_one_step():
    batch = ContinuousBatch(timing(), max_num_seqs=8, vocabulary=VOCABULARY)
    for name in "abcd":
        batch.add(sequence(name, max_tokens=3))
    tokens = run(batch)
    assert len({t for t, _ in tokens}) == 3, "four sequences, three steps"
    assert {r: len(e) for r, e in by_request(tokens).items()} == dict.fromkeys("abcd", 3)


def test_no_more_than_max_num_seqs_run_and_the_rest_wait_in_order():
    batch = ContinuousBatch(timing(), max_num_seqs=2, vocabulary=VOCABULARY)
    for name, arrival in (("a", 0.0), ("b", 0.001), ("c", 0.002)):
        batch.add(sequence(name, max_tokens=3, arrival_s=arrival))
    step = batch.schedule(0.005)
    assert step is not None and [s.request_id for s in step.sequences] == ["a", "b"]
    tokens = run(batch, start_s=step.end_s) + [(step.end_s, e) for e in batch.complete(step)]
    first = {r: min(t for t, e in tokens if e.sequence.request_id == r) for r in "abc"}
    last = {r: max(t for t, e in tokens if e.sequence.request_id == r) for r in "abc"}
    assert first["c"] > last["a"], "c starts when a slot frees"


def test_a_request_that_arrives_after_a_step_starts_waits_for_the_next():
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY)
    batch.add(sequence("late", arrival_s=1.0))
    assert batch.schedule(0.5) is None
    assert batch.schedule(1.0) is not None


def test_a_full_kv_cache_preempts_the_youngest_which_recomputes_and_still_completes():
    # Room for 40 tokens: two 10-token prompts growing to 30 tokens each cannot both stay.
    batch = ContinuousBatch(timing(capacity=40), max_num_seqs=4, vocabulary=VOCABULARY)
    old, young = sequence("old", max_tokens=20), sequence("young", max_tokens=20, arrival_s=0.001)
    batch.add(old)
    batch.add(young)
    tokens = run(batch, start_s=0.001)
    assert {r: len(e) for r, e in by_request(tokens).items()} == {"old": 20, "young": 20}
    assert any(kind is Event.PREEMPTED for kind, _ in young.events)
    assert not any(kind is Event.PREEMPTED for kind, _ in old.events)
    assert max(t for t, e in tokens if e.sequence is old) < max(t for t, e in tokens if e.sequence is young)
    assert batch.kv_used_tokens == 0


def test_with_priority_scheduling_the_waiting_go_by_priority_and_the_lowest_priority_is_preempted():
    """vLLM's priority policy: waiting requests by (priority, arrival); on a full KV cache the
    running request of highest priority value (then the latest) is preempted, here the older one."""
    batch = ContinuousBatch(timing(capacity=40), max_num_seqs=4, vocabulary=VOCABULARY, by_priority=True)
    low, high = sequence("low", max_tokens=20, priority=5), sequence("high", max_tokens=20, arrival_s=0.001)
    batch.add(low)
    batch.add(high)
    assert [s.request_id for s in batch.waiting] == ["high", "low"]
    tokens = run(batch, start_s=0.001)
    assert {r: len(e) for r, e in by_request(tokens).items()} == {"high": 20, "low": 20}
    assert any(kind is Event.PREEMPTED for kind, _ in low.events)
    assert not any(kind is Event.PREEMPTED for kind, _ in high.events)
    for priority, name in [(5, "a"), (0, "b"), (5, "c"), (1, "d")]:
        batch.add(sequence(name, priority=priority, arrival_s=1.0))
    assert [s.request_id for s in batch.waiting] == ["b", "d", "a", "c"]


def test_a_prompt_larger_than_the_kv_cache_is_refused():
    batch = ContinuousBatch(timing(capacity=40), max_num_seqs=4, vocabulary=VOCABULARY)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        batch.add(sequence("huge", prompt=40))


def test_an_abort_during_a_step_drops_its_token_and_frees_its_cache():
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY)
    batch.add(sequence("kept", max_tokens=2))
    batch.add(sequence("gone", max_tokens=2))
    step = batch.schedule(0.0)
    assert step is not None
    batch.abort(["gone", "never-seen"])
    assert [e.sequence.request_id for e in batch.complete(step)] == ["kept"]
    assert batch.kv_used_tokens == 10  # only "kept"'s prompt
    batch.add(sequence("waiting"))
    batch.abort(["waiting"])
    assert [s.request_id for s in batch.waiting] == []
    assert [e.sequence.request_id for _, e in run(batch)] == ["kept"]


def test_the_stop_token_ends_a_request_after_min_tokens_when_it_may_end_early():
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY, stop_probability=1.0)
    batch.add(sequence("eos", max_tokens=50, min_tokens=3))
    batch.add(sequence("stop-id", max_tokens=50, stop_token=42, stop_reason=42, avoid=frozenset({42})))
    batch.add(sequence("ignore-eos", max_tokens=6, stop_token=None))
    tokens = by_request(run(batch))
    eos = tokens["eos"]
    assert [e.token for e in eos[:3]] != [EOS] * 3 and EOS not in [e.token for e in eos[:3]]
    assert (len(eos), eos[-1].token, eos[-1].finish, eos[-1].stop_reason) == (4, EOS, Finish.STOP, None)
    stop_id = tokens["stop-id"]
    assert (len(stop_id), stop_id[-1].token, stop_id[-1].finish, stop_id[-1].stop_reason) == (1, 42, Finish.STOP, 42)
    assert [e.finish for e in tokens["ignore-eos"]] == [None] * 5 + [Finish.LENGTH]


def test_without_a_stop_probability_no_request_ends_early_nor_draws_its_stop_tokens():
    avoid = frozenset(VOCABULARY[:45])  # all but five tokens of the vocabulary
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY)
    batch.add(sequence("a", max_tokens=500, avoid=avoid))
    tokens = [e for _, e in run(batch)]
    assert len(tokens) == 500 and tokens[-1].finish is Finish.LENGTH
    assert {e.token for e in tokens} == set(VOCABULARY[45:])


def test_the_context_limit_ends_a_request_as_max_tokens_does():
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY)
    batch.add(sequence("a", prompt=10, max_tokens=100, max_model_len=14))
    tokens = [e for _, e in run(batch)]
    assert len(tokens) == 4 and tokens[-1].finish is Finish.LENGTH


def test_a_seed_gives_the_same_tokens_and_another_seed_others():
    def drawn(seed: int) -> list[int]:
        batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY)
        batch.add(sequence("a", max_tokens=40, rng=random.Random(seed)))
        return [e.token for _, e in run(batch)]

    assert drawn(7) == drawn(7)
    assert drawn(7) != drawn(8)


def test_throughput_at_64_sequences_is_what_the_timing_model_allows():
    h100 = GpuTiming.from_config(SimulatedEngineConfig())
    batch = ContinuousBatch(h100, max_num_seqs=64, vocabulary=VOCABULARY)
    for i in range(64):
        batch.add(sequence(str(i), prompt=32, max_tokens=256))
    tokens = run(batch)
    elapsed = tokens[-1][0]
    decode_s = sum(h100.step_s(64 * (32 + k), 0) for k in range(1, 256))
    prefill_s = h100.step_s(64 * 32, 64 * 32)
    assert elapsed == pytest.approx(prefill_s + decode_s)
    assert len(tokens) / elapsed == pytest.approx(64 * 256 / (prefill_s + decode_s))
    assert math.isclose(len(tokens), 64 * 256)
