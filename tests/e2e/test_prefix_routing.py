"""Prefix-aware routing, two model replicas: conversations stay where their history is cached,
and one hot prompt still reaches both replicas.

A third application (``prefix``: the bed's application under ``/prefix``) runs two model
replicas, pinned, on the simulated engine with its prefix cache (vLLM's automatic prefix
caching as the engine core does it: docs/simulated-engine.md). Whether a turn found its
history cached is vLLM's own answer: ``usage.prompt_tokens_details.cached_tokens``. Each
conversation has its own system prompt, so only the replica that served its earlier turns
holds any of its prompt: a later turn sent to the other replica would find nothing cached.

Both data paths are tested: the relay path, where the ingress's handle runs the router,
and direct streaming, where the ReplicaPicker runs it for HAProxy with each request's
body (deploy/cluster.env) and is told of each pick, since Serve dispatches nothing there.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.apps import application
from tests.e2e.serve_state import (
    DeploymentName,
    haproxy_routes_to,
    live_replicas,
    ongoing_at,
    running,
    serve_deploy,
    serve_deploy_settled,
)
from tests.e2e.simulation import SimulatedEngines
from tests.waiting import wait_until

MODEL = DeploymentName("prefix", "model-glm-4-9b-chat")
MODEL_NAME = "glm-4-9b-chat"
CONVERSATIONS = 8
TURNS = 4
ANSWER_TOKENS = 16
HOT_BURST = 40  # identical requests, held while both engines are paused


def prefix_app(base: dict[str, Any], direct_streaming: bool) -> dict[str, Any]:
    """The bed's application under another name and route, with two model replicas pinned."""
    app = copy.deepcopy(base)
    app["name"], app["route_prefix"] = "prefix", "/prefix"
    app["args"]["ingress"]["direct_streaming"] = direct_streaming
    (model,) = app["args"]["models"]
    assert model["prefix_routing"]["enabled"]  # the shipped config routes by prefix
    model["deployment"]["num_replicas"] = 2
    return app


def system_prompt(n: int) -> str:
    """A system prompt of a few hundred tokens that no other conversation shares."""
    return f"Conversation {n}. " + " ".join(f"rule {n}-{i}: answer with care and brevity." for i in range(14))


async def healthy(origin: str) -> bool:
    async with httpx.AsyncClient(base_url=origin, timeout=10) as client:
        return (await client.get("/prefix/health")).status_code == 200


async def converse(client: httpx.AsyncClient, n: int) -> list[dict[str, int]]:
    """One conversation of TURNS turns, each resending the history; each turn's usage."""
    messages = [{"role": "system", "content": system_prompt(n)}, {"role": "user", "content": "First question?"}]
    usages = []
    for turn in range(TURNS):
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": ANSWER_TOKENS, "min_tokens": ANSWER_TOKENS}
        response = await client.post("/prefix/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        usage = answer["usage"]
        usages.append({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]})
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Question number {turn + 2}?"},
        ]
    return usages


@pytest.mark.parametrize("direct_streaming", [False, True], ids=["relay", "direct streaming"])
async def test_turns_find_their_history_cached_and_a_hot_prompt_reaches_both_replicas(
    sim_app, cluster, ray_cluster, tmp_path, direct_streaming
):
    app = sim_app
    config = yaml.safe_load(app.config_path.read_text())
    both = copy.deepcopy(config)
    both["applications"].append(prefix_app(application(config, app.name), direct_streaming))
    both_path = tmp_path / "with-prefix-app.yaml"
    both_path.write_text(yaml.safe_dump(both, sort_keys=False))
    try:
        await serve_deploy(both_path, cluster)
        await wait_until(lambda: running(MODEL, 2), 120, "the prefix app's two model replicas running")
        await wait_until(lambda: healthy(app.origin), 60, "the prefix app answering /health")
        if direct_streaming:
            # Until HAProxy's configuration names a new replica, a request pinned to it goes to
            # the fallback proxy, whose own router (with a table of its own) picks again.
            stats = ray_cluster.haproxy_stats_url
            await wait_until(lambda: haproxy_routes_to(stats, MODEL, 2), 60, "HAProxy routing to both replicas")
        limits = httpx.Limits(max_connections=HOT_BURST + CONVERSATIONS)
        async with httpx.AsyncClient(base_url=app.origin, timeout=120, limits=limits) as client:
            conversations = await asyncio.gather(*(converse(client, n) for n in range(CONVERSATIONS)))
            for n, usages in enumerate(conversations):
                assert usages[0]["prompt"] > 250, usages  # several KV blocks of its own
                for before, turn in zip(usages, usages[1:], strict=False):
                    # The replica that served the turn before holds it: at least half of it is cached.
                    assert turn["cached"] >= before["prompt"] // 2, (n, usages)
            later = [turn for usages in conversations for turn in usages[1:]]
            hit_rate = sum(t["cached"] for t in later) / sum(t["prompt"] for t in later)
            print(
                f"{CONVERSATIONS} conversations x {TURNS} turns: turns >= 2 had {hit_rate:.0%} of their prompt cached"
            )

            # One hot prompt: while both engines are paused, whatever a replica admits stays in its count.
            replicas = list(await live_replicas(MODEL))
            hot = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "The same question, again."}]}
            async with SimulatedEngines(MODEL).paused():
                burst = [
                    asyncio.create_task(client.post("/prefix/v1/chat/completions", json=hot | {"max_tokens": 8}))
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
        # Load first: past the gap the holder loses requests to the other replica, which then holds
        # the prompt too and shares it.
        assert min(held) >= 1, held
        print(f"{HOT_BURST} identical requests: {held} held by the two replicas")
    finally:
        await serve_deploy_settled(app.config_path, cluster)  # the prefix app goes
