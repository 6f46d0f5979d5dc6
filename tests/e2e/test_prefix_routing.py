"""Prefix-aware routing, two model replicas: conversations stay where their history is cached,
and one hot prompt still reaches both replicas.

The ``prefix`` variant (the bed's application under ``/prefix``: tests/e2e/harness/apps.py) runs two
model replicas, pinned, on the simulated engine with its prefix cache (vLLM's automatic prefix
caching as the engine core does it: docs/simulated-engine.md); the conversations are
:mod:`tests.e2e.harness.conversations`.

The ReplicaPicker runs the router for HAProxy with each request's body (deploy/cluster.env)
and is told of each pick, since Serve dispatches nothing there. Under a bare ``serve run`` the
same conversations find their history cached too (test_bare_serve_run.py).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml

from tests.e2e.harness.apps import RunningApp, application
from tests.e2e.harness.conversations import CONVERSATIONS, MODEL_NAME, check_turns
from tests.e2e.harness.serve_state import (
    DeploymentName,
    haproxy_routes_to,
    live_replicas,
    ongoing_at,
)
from tests.e2e.harness.simulation import SimulatedEngines, ready_bed
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("prefix")

HOT_BURST = 40  # identical requests, held while both engines are paused


async def test_turns_find_their_history_cached_and_a_hot_prompt_reaches_both_replicas(variants, ray_cluster):
    prefix = await ready_bed(variants["prefix"], replicas=2)
    # Until HAProxy's configuration names a new replica, a request pinned to it goes to
    # the fallback proxy, whose own router (with a table of its own) picks again.
    stats = ray_cluster.haproxy_stats_url
    await wait_until(lambda: haproxy_routes_to(stats, prefix.model, 2), 60, "HAProxy routing to both replicas")
    await check_turns_and_hot_prompt(prefix.app, prefix.model)


async def check_turns_and_hot_prompt(app: RunningApp, model: DeploymentName) -> None:
    limits = httpx.Limits(max_connections=HOT_BURST + CONVERSATIONS)
    async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=limits) as client:
        await check_turns(client)

        # One hot prompt: while both engines are paused, whatever a replica admits stays in its count.
        replicas = list(await live_replicas(model))
        hot = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "The same question, again."}]}
        async with SimulatedEngines(model).paused():
            burst = [
                asyncio.create_task(client.post("/v1/chat/completions", json=hot | {"max_tokens": 8}))
                for _ in range(HOT_BURST)
            ]

            async def counts() -> list[int]:
                return [await ongoing_at(replica) for replica in replicas]

            async def all_admitted() -> bool:
                return sum(await counts()) == HOT_BURST

            await wait_until(all_admitted, 60, f"the {HOT_BURST} hot requests admitted")
            held = await counts()
        answers = await asyncio.gather(*burst)
    assert [a.status_code for a in answers] == [200] * HOT_BURST, [a.text for a in answers if a.status_code != 200]
    print(f"{HOT_BURST} identical requests: {held} held by the two replicas")
    # Shared by load: copies of one prompt spread over the replicas, and no replica is preferred
    # while it runs more than the variant's max_load_gap beyond the other (one request may land
    # as the gap is reached).
    gap = max_load_gap(app)
    assert min(held) >= 1 and max(held) - min(held) <= gap + 1, (held, gap)


def max_load_gap(app: RunningApp) -> int:
    """The application's prefix_routing.max_load_gap, as the suite deployed it."""
    (model,) = application(yaml.safe_load(app.config_path.read_text()), app.name)["args"]["models"]
    return model["prefix_routing"]["max_load_gap"]
