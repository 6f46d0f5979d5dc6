"""Prefix-aware routing, two model replicas: conversations stay where their history is cached,
and one hot prompt still reaches both replicas.

The ``prefix`` variant (the bed's application under ``/prefix``: tests/e2e/harness/apps.py) runs two
model replicas, pinned, on the simulated engine with its prefix cache (vLLM's automatic prefix
caching as the engine core does it: docs/simulated-engine.md). Whether a turn found its
history cached is vLLM's own answer: ``usage.prompt_tokens_details.cached_tokens``. Each
conversation has its own system prompt, so only the replica that served its earlier turns
holds any of its prompt: a later turn sent to the other replica would find nothing cached.

The ReplicaPicker runs the router for HAProxy with each request's body (deploy/cluster.env)
and is told of each pick, since Serve dispatches nothing there. Under a bare ``serve run``
(Ray's own settings: no HAProxy) Serve's Python proxy picks a replica by load, and that replica
asks the ReplicaPicker where the parsed request runs, answering it or sending it on: the same
conversations find their history cached there too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.e2e.harness.apps import RunningApp, application
from tests.e2e.harness.ray_cluster import RayCluster, free_port
from tests.e2e.harness.serve_run import start_serve_run, stop, wait_until_healthy
from tests.e2e.harness.serve_state import (
    DeploymentName,
    haproxy_routes_to,
    live_replicas,
    ongoing_at,
)
from tests.e2e.harness.simulation import SimulatedEngines, ready_bed
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("prefix")

MODEL_NAME = "glm-4-9b-chat"
CONVERSATIONS = 8
TURNS = 4
ANSWER_TOKENS = 16
HOT_BURST = 40  # identical requests, held while both engines are paused
BARE_START_S = 300  # a backstop over the bare cluster's start and its two replicas' (about a minute)


def system_prompt(n: int) -> str:
    """A system prompt of a few hundred tokens that no other conversation shares."""
    return f"Conversation {n}. " + " ".join(f"rule {n}-{i}: answer with care and brevity." for i in range(14))


async def healthy(app: RunningApp) -> bool:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{app.url}/health")).status_code == 200


async def converse(client: httpx.AsyncClient, n: int) -> list[dict[str, int]]:
    """One conversation of TURNS turns, each resending the history; each turn's usage."""
    messages = [{"role": "system", "content": system_prompt(n)}, {"role": "user", "content": "First question?"}]
    usages = []
    for turn in range(TURNS):
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": ANSWER_TOKENS, "min_tokens": ANSWER_TOKENS}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        usage = answer["usage"]
        usages.append({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]})
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Question number {turn + 2}?"},
        ]
    return usages


async def test_turns_find_their_history_cached_and_a_hot_prompt_reaches_both_replicas(variants, ray_cluster):
    prefix = await ready_bed(variants["prefix"], replicas=2)
    # Until HAProxy's configuration names a new replica, a request pinned to it goes to
    # the fallback proxy, whose own router (with a table of its own) picks again.
    stats = ray_cluster.haproxy_stats_url
    await wait_until(lambda: haproxy_routes_to(stats, prefix.model, 2), 60, "HAProxy routing to both replicas")
    await check_turns_and_hot_prompt(prefix.app, prefix.model)


async def check_turns(client: httpx.AsyncClient) -> None:
    """Every later turn of every conversation finds at least half of its prompt cached."""
    conversations = await asyncio.gather(*(converse(client, n) for n in range(CONVERSATIONS)))
    for n, usages in enumerate(conversations):
        assert usages[0]["prompt"] > 250, usages  # several KV blocks of its own
        for before, turn in zip(usages, usages[1:], strict=False):
            # The replica that served the turn before holds it: at least half of it is cached.
            assert turn["cached"] >= before["prompt"] // 2, (n, usages)
    later = [turn for usages in conversations for turn in usages[1:]]
    hit_rate = sum(t["cached"] for t in later) / sum(t["prompt"] for t in later)
    print(f"{CONVERSATIONS} conversations x {TURNS} turns: turns >= 2 had {hit_rate:.0%} of their prompt cached")


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


@pytest.fixture(scope="module")
def bare_serve_run(variants, tmp_path_factory) -> Iterator[RunningApp]:
    """The ``prefix`` application alone under a bare ``serve run``: a Ray cluster of its own started
    with Ray's defaults (no deploy/cluster.env, so no HAProxy: the ReplicaPicker is asked by the
    model replicas), and the suite's config reduced to that application on ports of its own."""
    suite = yaml.safe_load(variants["prefix"].config_path.read_text())
    prefix = application(suite, "prefix")
    port, grpc_port = free_port(), free_port()
    config = suite | {
        "http_options": suite["http_options"] | {"port": port},
        "grpc_options": suite["grpc_options"] | {"port": grpc_port},
        "applications": [prefix],
    }
    workdir = tmp_path_factory.mktemp("bare")
    config_path, log_path = workdir / "config.yaml", workdir / "serve.log"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    app = RunningApp(
        name=prefix["name"],
        origin=f"http://127.0.0.1:{port}",
        route_prefix=prefix["route_prefix"],
        grpc_target=f"127.0.0.1:{grpc_port}",
        model=MODEL_NAME,
        model_path=variants["prefix"].model_path,
        log_path=log_path,
        config_path=config_path,
    )
    # Ray's defaults, but for the node's own drain at its stop (30 s: nothing is left to move by then).
    cluster = RayCluster(settings={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        cluster.start()
        proc = start_serve_run(cluster.address, config_path, log_path, os.environ | cluster.env)
        try:
            wait_until_healthy([app.url], proc, log_path, BARE_START_S)
            yield app
        finally:
            stop(proc)
    finally:
        cluster.stop()


async def test_under_a_bare_serve_run_turns_find_their_history_cached(bare_serve_run):
    """Without HAProxy the replica Serve's proxy picked (by load) asks the ReplicaPicker which replica
    answers, and answers or sends the request on."""
    async with httpx.AsyncClient(base_url=bare_serve_run.url, timeout=120) as client:
        await check_turns(client)
