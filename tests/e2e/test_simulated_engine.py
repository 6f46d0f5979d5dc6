"""The simulated engine behind vLLM's real ``AsyncLLM``, then behind the whole app with 4 replicas.

First, in this process and without HTTP: vLLM's ``AsyncLLM`` on the simulated
engine core answers as the real engine does for what the simulation replaces
(exact lengths, ``n``, seeds, stop tokens after ``min_tokens``, ``ignore_eos``,
logprobs, aborts). Then deploy/config.sim.yaml's application, as a second
application on the suite's cluster with 4 replicas and no load time: 256
concurrent streams all complete with exactly their lengths, and every replica
served some of them.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.sse import post_stream
from tests.e2e.telemetry import scrape, wait_until

REPO = Path(__file__).resolve().parents[2]
SIM_CONFIG = REPO / "deploy" / "config.sim.yaml"
APP_NAME = "glm-sim"
ROUTE_PREFIX = "/sim"
REPLICAS = 4
STREAMS = 256


def sim_app_args() -> dict:
    return yaml.safe_load(SIM_CONFIG.read_text())["applications"][0]["args"]


# --- vLLM's AsyncLLM on the simulated engine core, in this process ---


def simulated_engine(**settings):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from serve_app.config import SimulatedEngineConfig, split_engine_args
    from serve_app.simulated_engine.core import simulated_async_llm

    model = sim_app_args()["models"][0]
    engine_kwargs, _ = split_engine_args(model["engine_args"])
    engine_args = AsyncEngineArgs(**engine_kwargs, served_model_name=[model["name"]])
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    config = SimulatedEngineConfig(**(model["simulated_engine"] | settings))
    return simulated_async_llm(vllm_config, config, usage_context=UsageContext.OPENAI_API_SERVER)


async def generate(engine, request_id: str, prompt_tokens: int = 16, **params):
    from vllm import SamplingParams

    final = None
    async for output in engine.generate(
        {"prompt_token_ids": list(range(20, 20 + prompt_tokens))}, SamplingParams(**params), request_id
    ):
        final = output
    return final


@pytest.fixture
async def engine():
    engine = simulated_engine()
    yield engine
    engine.shutdown()


async def test_concurrent_requests_get_exactly_their_lengths_and_n_choices(engine):
    lengths = [1 + 7 * i for i in range(32)]
    outputs = await asyncio.gather(
        *(generate(engine, f"r{i}", max_tokens=n) for i, n in enumerate(lengths)),
        generate(engine, "three", max_tokens=9, n=3),
    )
    for output, n in zip(outputs, lengths, strict=False):
        [choice] = output.outputs
        assert (len(choice.token_ids), choice.finish_reason) == (n, "length")
    assert [(len(c.token_ids), c.finish_reason) for c in outputs[-1].outputs] == [(9, "length")] * 3
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


# --- deploy/config.sim.yaml's application, 4 replicas ---


@pytest.fixture(scope="module")
def sim_app(app, cluster):
    """deploy/config.sim.yaml's application next to the suite's app: 4 replicas, no load time."""
    from ray import serve

    from serve_app.app import build_app

    args = copy.deepcopy(sim_app_args())
    model = args["models"][0]
    model["simulated_engine"]["load_s"] = 0
    del model["deployment"]["autoscaling_config"]
    model["deployment"]["num_replicas"] = REPLICAS
    serve.run(build_app(args), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    url = app.url + ROUTE_PREFIX
    wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, 120, "the simulated app healthy")
    yield url
    serve.delete(APP_NAME)


async def test_the_simulated_app_says_it_is_simulated(sim_app):
    async with httpx.AsyncClient(base_url=sim_app, timeout=60) as client:
        [model] = (await client.get("/v1/models")).json()["data"]
        assert (model["owned_by"], model["simulated"]) == ("simulated", True)
        body = {"model": model["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        answer = (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["system_fingerprint"].startswith("simulated")
        assert answer["usage"]["completion_tokens"] == 8


async def test_256_streams_complete_with_exact_lengths_on_all_4_replicas(sim_app, metrics_url):
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    lengths = [32 + i % 97 for i in range(STREAMS)]
    async with httpx.AsyncClient(base_url=sim_app, timeout=300, limits=limits) as client:
        streams = await asyncio.gather(
            *(
                post_stream(
                    client,
                    "/v1/completions",
                    {
                        "model": "glm-4-9b-chat",
                        "prompt": "Tell me about the sea. " * 4,
                        "max_tokens": n,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )
                for n in lengths
            )
        )
    for stream, n in zip(streams, lengths, strict=True):
        assert stream.status == 200 and stream.done
        chunks = stream.chunks
        assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == n
        assert not any("error" in json.loads(e) for e in stream.events[:-1])

    seen: dict[str, float] = {}

    def requests_per_replica() -> dict[str, float] | None:
        """Requests each model replica of the simulated app answered (Serve's own counter)."""
        seen.clear()
        for (name, labels), value in scrape(metrics_url).items():
            tags = dict(labels)
            if (
                name == "ray_serve_deployment_request_counter_total"
                and tags.get("application") == APP_NAME
                and tags.get("deployment") == "model-glm-4-9b-chat"
            ):
                seen[tags["replica"]] = seen.get(tags["replica"], 0.0) + value
        # (the model deployment also answered the one chat request of the test above, if it ran)
        return dict(seen) if sum(seen.values()) >= STREAMS else None

    try:
        counts = wait_until(requests_per_replica, 60, f"the {STREAMS} requests counted by replica")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; counted so far: {seen}") from None
    assert len(counts) == REPLICAS and all(value > 0 for value in counts.values()), counts
