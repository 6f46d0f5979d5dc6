"""The simulated engine behind vLLM's real ``AsyncLLM``, in this process and without HTTP.

vLLM's ``AsyncLLM`` on the simulated engine core answers as the real engine does for what the
simulation replaces (exact lengths, ``n``, seeds, stop tokens after ``min_tokens``,
``ignore_eos``, logprobs, aborts), and its controls (pause, pace, fail, hang) act as the load
and fault tests rely on. (Moved from the end-to-end suite: nothing here needs a cluster.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.waiting import wait_until

SIM_CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "config.sim.yaml"


def sim_app_args() -> dict:
    return yaml.safe_load(SIM_CONFIG.read_text())["applications"][0]["args"]


def simulated_engine(**settings):
    """vLLM's AsyncLLM on the simulated core, built as a model replica builds it, with ``settings``."""
    from serve_app.config import ModelConfig
    from serve_app.engine.build import build_engine, engine_config

    args = sim_app_args()["models"][0]
    model = ModelConfig.model_validate(args | {"simulated_engine": args["simulated_engine"] | settings})
    return build_engine(engine_config(model))


async def generate(engine, request_id: str, prompt_tokens: int = 16, first_token: int = 20, **params):
    from vllm import SamplingParams

    final = None
    prompt = list(range(first_token, first_token + prompt_tokens))
    async for output in engine.generate({"prompt_token_ids": prompt}, SamplingParams(**params), request_id):
        final = output
    return final


async def choices(engine, request_id: str, **params) -> list[Any]:
    """Each choice's last output, in index order. With n > 1, vLLM yields a choice's progress in the
    output of the engine step that made it: choices that finish in different steps (a child
    request admitted a step later, on a busy machine) end in different outputs."""
    from vllm import SamplingParams

    last: dict[int, Any] = {}
    async for output in engine.generate(
        {"prompt_token_ids": list(range(20, 36))}, SamplingParams(**params), request_id
    ):
        for choice in output.outputs:
            last[choice.index] = choice
    return [last[index] for index in sorted(last)]


@pytest.fixture
async def engine():
    engine = simulated_engine()
    yield engine
    engine.shutdown()


async def test_concurrent_requests_get_exactly_their_lengths_and_n_choices(engine):
    lengths = [1 + 7 * i for i in range(32)]
    outputs = await asyncio.gather(
        *(generate(engine, f"r{i}", max_tokens=n) for i, n in enumerate(lengths)),
        choices(engine, "three", max_tokens=9, n=3),
    )
    for output, n in zip(outputs, lengths, strict=False):
        [choice] = output.outputs
        assert (len(choice.token_ids), choice.finish_reason) == (n, "length")
    assert [(len(c.token_ids), c.finish_reason) for c in outputs[-1]] == [(9, "length")] * 3
    assert engine.engine_core.batch.idle and engine.engine_core.batch.kv_used_tokens == 0


async def test_a_seed_gives_the_same_tokens(engine):
    first = await generate(engine, "a", max_tokens=32, seed=11)
    again = await generate(engine, "b", max_tokens=32, seed=11)
    other = await generate(engine, "c", max_tokens=32, seed=12)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids != other.outputs[0].token_ids


async def test_logprobs_are_those_of_the_uniform_draw(engine):
    import math

    output = await generate(engine, "lp", max_tokens=4, logprobs=2)
    choice = output.outputs[0]
    assert len(choice.logprobs) == 4
    vocabulary = len(engine.engine_core.batch.vocabulary)
    for token, position in zip(choice.token_ids, choice.logprobs, strict=True):
        assert token in position and len(position) == 3
        assert position[token].logprob == pytest.approx(-math.log(vocabulary))


async def test_stop_tokens_end_answers_after_min_tokens_unless_ignore_eos():
    engine = simulated_engine(stop_probability=1.0)
    try:
        eos = engine.model_config.hf_config.eos_token_id
        stopped = (await generate(engine, "s", max_tokens=50, min_tokens=5)).outputs[0]
        assert (len(stopped.token_ids), stopped.token_ids[-1], stopped.finish_reason) == (6, eos, "stop")
        ignored = (await generate(engine, "i", max_tokens=20, ignore_eos=True)).outputs[0]
        assert (len(ignored.token_ids), ignored.finish_reason) == (20, "length")
        by_id = (await generate(engine, "t", max_tokens=20, ignore_eos=True, stop_token_ids=[42])).outputs[0]
        assert (by_id.token_ids[-1], by_id.finish_reason, by_id.stop_reason) == (42, "stop", 42)
    finally:
        engine.shutdown()


async def test_a_repeated_prompt_finds_its_whole_blocks_cached_as_vllm_reports_them(engine):
    first = await generate(engine, "first", prompt_tokens=100, max_tokens=2)
    again = await generate(engine, "again", prompt_tokens=100, max_tokens=2)
    # 16-token blocks, short of the last token: 6 whole blocks of the 100 tokens.
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 96)


async def test_a_client_that_leaves_frees_the_engine(engine):
    from vllm import SamplingParams

    stream = engine.generate({"prompt_token_ids": [20] * 16}, SamplingParams(max_tokens=5000), "leaves")
    async for output in stream:
        if len(output.outputs[0].token_ids) >= 3:
            break
    await stream.aclose()  # as the serving layer does when its client disconnects
    assert engine.engine_core.batch.idle
    assert engine.get_num_unfinished_requests() == 0


# --- the controls tests drive it with (serve_app.simulated_engine.controls) ---


async def test_paused_it_holds_what_arrives_and_resumed_it_completes_it(engine):
    from serve_app.simulated_engine.controls import Control

    core = engine.engine_core
    assert core.control(Control.PAUSE).paused
    held = [asyncio.create_task(generate(engine, f"p{i}", max_tokens=8)) for i in range(4)]
    state = await until(lambda: (s := core.state()).waiting == 4 and s)
    assert (state.running, state.tokens) == (0, 0)  # held, not started: no token came
    resumed = core.control(Control.RESUME)
    assert not resumed.paused and resumed.holds == 4
    outputs = await asyncio.gather(*held)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * 4
    assert core.state().tokens == 32


async def test_paused_it_still_reports_to_the_replicas_watch_and_hung_it_does_not(engine):
    from serve_app.simulated_engine.controls import HEARTBEAT_S, Control

    core = engine.engine_core
    handler = engine.output_handler  # vLLM's task that reads the core: stopped, so this test reads it
    handler.cancel()
    await asyncio.gather(handler, return_exceptions=True)
    core.control(Control.PAUSE)
    beat = await asyncio.wait_for(core.get_output_async(), timeout=10 * HEARTBEAT_S)
    assert beat.outputs == [] and beat.scheduler_stats is not None  # alive, busy elsewhere
    core.control(Control.HANG)
    with pytest.raises(TimeoutError):  # not even a heartbeat: what the watch takes for a hung engine
        await asyncio.wait_for(core.get_output_async(), timeout=4 * HEARTBEAT_S)


async def test_pace_stretches_every_step_of_the_timing_model(engine):
    from serve_app.simulated_engine.controls import Control

    core = engine.engine_core

    async def gpu_time(first_token: int) -> float:
        """Simulated GPU time of one 12-token answer to a 16-token prompt (prompts differ: nothing cached)."""
        before = core.state().busy_s
        await generate(engine, f"pace-{first_token}", first_token=first_token, max_tokens=12)
        return core.state().busy_s - before

    normal = await gpu_time(first_token=20)
    assert core.control(Control.PACE, pace=3.0).pace == 3.0
    slow = await gpu_time(first_token=60)
    assert normal > 0 and slow == pytest.approx(3 * normal), (normal, slow)
    with pytest.raises(ValueError, match="positive"):
        core.control(Control.PACE, pace=0)


async def test_failed_it_ends_what_it_holds_through_vllms_engine_dead_path():
    from vllm.v1.engine.exceptions import EngineDeadError

    from serve_app.simulated_engine.controls import Control

    engine = simulated_engine()
    try:
        core = engine.engine_core
        core.control(Control.PAUSE)
        held = [asyncio.create_task(generate(engine, f"f{i}", max_tokens=8)) for i in range(3)]
        await until(lambda: core.state().waiting == 3)
        assert core.control(Control.FAIL).dead
        results = await asyncio.gather(*held, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.errored  # what the replica's engine watch reads
        with pytest.raises(EngineDeadError):
            await generate(engine, "after", max_tokens=1)
    finally:
        engine.shutdown()


async def until(condition, within_s: float = 10.0):
    """The engine runs in this loop: yield to it until ``condition()`` is true (its value)."""
    return await wait_until(condition, within_s, "the simulated engine's state", every_s=0.01)
