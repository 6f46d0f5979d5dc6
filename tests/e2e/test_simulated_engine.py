"""The simulated engine behind the whole app: the bed (deploy/config.sim.yaml's application) with 4
replicas, where 256 concurrent streams all complete with exactly their lengths, and every
replica served some of them. (vLLM's AsyncLLM on the simulated engine core, in one process:
tests/unit/test_simulated_async_llm.py.)
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import yaml

from tests.e2e.apps import application
from tests.e2e.serve_state import serve_deploy_settled
from tests.e2e.sse import post_stream
from tests.e2e.telemetry import scrape, settled
from tests.waiting import wait_until

REPLICAS = 4
STREAMS = 256


# --- the bed (deploy/config.sim.yaml's application), 4 replicas ---


@pytest.fixture(scope="module")
async def four_replicas(sim_app, cluster, tmp_path_factory):
    """The bed with 4 model replicas, 1 again after: set in Serve's own ``deployments`` overrides of
    the application, a lightweight update (the running replica stays). Serve counts an
    application's ``args`` as its code, so the same change in ``args`` (models[].deployment)
    would replace every replica (docs/operations.md)."""
    config = yaml.safe_load(sim_app.config_path.read_text())
    bed = application(config, sim_app.name)
    bed["deployments"] = [{"name": sim_app.model_deployment, "num_replicas": REPLICAS}]
    path = tmp_path_factory.mktemp("four") / "bed-with-4-replicas.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    await serve_deploy_settled(path, cluster, settled={sim_app.name})
    try:
        yield sim_app
    finally:
        await serve_deploy_settled(sim_app.config_path, cluster, settled={sim_app.name})


async def test_the_simulated_app_says_it_is_simulated(four_replicas):
    async with httpx.AsyncClient(base_url=four_replicas.url, timeout=60) as client:
        models = await client.get("/v1/models")
        assert models.status_code == 200, models.text
        [model] = models.json()["data"]
        assert (model["owned_by"], model["simulated"]) == ("simulated", True)
        body = {"model": model["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        answer = (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["system_fingerprint"].startswith("simulated")
        assert answer["usage"]["completion_tokens"] == 8


async def test_256_streams_complete_with_exact_lengths_on_all_4_replicas(four_replicas, metrics_url):
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    lengths = [32 + i % 97 for i in range(STREAMS)]
    before = await settled(metrics_url, "ray_serve_deployment_request_counter_total")  # earlier requests all reported
    async with httpx.AsyncClient(base_url=four_replicas.url, timeout=300, limits=limits) as client:
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
        """Requests each model replica of the bed answered since the streams began (Serve's own counter)."""
        seen.clear()
        after = scrape(metrics_url)
        for (name, labels), value in after.items():
            tags = dict(labels)
            if (
                name == "ray_serve_deployment_request_counter_total"
                and tags.get("application") == four_replicas.name
                and tags.get("deployment") == four_replicas.model_deployment
            ):
                grown = value - before.get((name, labels), 0.0)
                seen[tags["replica"]] = seen.get(tags["replica"], 0.0) + grown
        return {replica: n for replica, n in seen.items() if n} if sum(seen.values()) >= STREAMS else None

    try:
        counts = await wait_until(requests_per_replica, 60, f"the {STREAMS} requests counted by replica")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; counted so far: {seen}") from None
    assert len(counts) == REPLICAS and sum(counts.values()) == STREAMS, counts
