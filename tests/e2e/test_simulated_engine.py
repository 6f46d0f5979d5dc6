"""The simulated engine behind the whole app, on the bed's ``prefix`` variant (deploy/config.sim.yaml's
application with two model replicas, routed by prefix as shipped): 256 concurrent streams all
complete with exactly their lengths, and both replicas served some of them (one prompt for all:
past its holder's load by ``prefix_routing.max_load_gap``, it goes to the other). (vLLM's
AsyncLLM on the simulated engine core, in one process: tests/unit/simulated_engine/test_async_llm.py.)

The variant is one the suite runs anyway: the test adds no replica (it started 3 more, and
stopped them after, when it ran on the bed at 4 replicas).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.harness.apps import RunningApp
from tests.e2e.harness.simulation import ready_bed
from tests.e2e.harness.sse import post_stream
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, settled
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("prefix")

REPLICAS = 2
STREAMS = 256


@pytest.fixture
async def two_replicas(variants) -> RunningApp:
    """``prefix``: the bed with two model replicas, running at the timing model's pace, holding nothing."""
    return (await ready_bed(variants["prefix"], replicas=REPLICAS)).app


async def test_the_simulated_app_says_it_is_simulated(two_replicas):
    async with httpx.AsyncClient(base_url=two_replicas.url, timeout=60) as client:
        models = await client.get("/v1/models")
        assert models.status_code == 200, models.text
        [model] = models.json()["data"]
        assert (model["owned_by"], model["simulated"]) == ("simulated", True)
        body = {"model": model["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        answer = (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["system_fingerprint"].startswith("simulated")
        assert answer["usage"]["completion_tokens"] == 8


async def test_256_streams_complete_with_exact_lengths_on_both_replicas(two_replicas, metrics_url):
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    lengths = [32 + i % 97 for i in range(STREAMS)]
    before = await settled(metrics_url, "ray_serve_deployment_request_counter_total")  # earlier requests all reported
    async with httpx.AsyncClient(base_url=two_replicas.url, timeout=300, limits=limits) as client:
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
        """Requests each model replica answered since the streams began (Serve's own counter)."""
        seen.clear()
        after = scrape(metrics_url)
        for (name, labels), value in after.items():
            tags = dict(labels)
            if (
                name == "ray_serve_deployment_request_counter_total"
                and tags.get("application") == two_replicas.name
                and tags.get("deployment") == two_replicas.model_deployment
            ):
                grown = value - before.get((name, labels), 0.0)
                seen[tags["replica"]] = seen.get(tags["replica"], 0.0) + grown
        return {replica: n for replica, n in seen.items() if n} if sum(seen.values()) >= STREAMS else None

    try:
        counts = await wait_until(
            requests_per_replica, 60, f"the {STREAMS} requests counted by replica", every_s=SCRAPE_EVERY_S
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; counted so far: {seen}") from None
    assert len(counts) == REPLICAS and sum(counts.values()) == STREAMS, counts
