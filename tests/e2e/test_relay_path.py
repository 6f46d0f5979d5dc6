"""The relay path on the bed's cluster: the Ingress deployment answers clients, the model replica streams to it.

Every shipped config streams answers from the model replica itself (``ingress.direct_streaming``,
docs/architecture.md record 14), so the rest of the suite runs that path. The relay path stays
for an application of several models and a cluster without Serve's HAProxy; a third
application here (``relay``: the bed's application with ``ingress.direct_streaming`` false,
under ``/relay``) keeps its contract proven where it differs: the Ingress deployment answers
and logs each request, Serve's queue in the ingress bounds what waits (429 ``overloaded`` and
gRPC ``RESOURCE_EXHAUSTED`` past it, while ``/health`` answers), and a replica whose engine
died ends its streams with an error event and leaves by itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from serve_app.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.apps import QUEUES, TAKES, RunningApp
from tests.e2e.beside_the_bed import deployed_beside_the_bed, small_queue_variant
from tests.e2e.bodies import LONG, chat, grpc_chat
from tests.e2e.grpc_calls import call, channel
from tests.e2e.serve_state import (
    DeploymentName,
    death_reason,
    request_log_lines,
)
from tests.e2e.simulation import SimulatedEngines
from tests.e2e.sse import post_stream
from tests.e2e.telemetry import scrape, total
from tests.waiting import wait_until

NAME, ROUTE = "relay", "/relay"
MODEL = DeploymentName(NAME, "model-glm-4-9b-chat")
INGRESS = DeploymentName(NAME, "Ingress")


@pytest.fixture(scope="module")
async def relay(
    sim_app: RunningApp, cluster: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningApp]:
    variant = small_queue_variant(sim_app, NAME, ROUTE, direct_streaming=False)
    async with deployed_beside_the_bed(
        sim_app, cluster, tmp_path_factory.mktemp(NAME), variant, [MODEL, INGRESS]
    ) as app:
        yield app


def _session_dir() -> str:
    return ray._private.worker.global_worker.node.get_session_dir_path()


async def test_the_ingress_answers_streams_and_whole_answers_and_logs_each(relay: RunningApp) -> None:
    status = await asyncio.to_thread(serve.status)
    assert set(status.applications[NAME].deployments) >= {INGRESS.deployment_name, MODEL.deployment_name}
    assert not relay.direct_streaming
    async with httpx.AsyncClient(base_url=relay.url, timeout=60) as client:
        stream = await post_stream(
            client, "/v1/chat/completions", chat(relay.model, 16, stream=True), headers={"X-Request-Id": "relay-stream"}
        )
        whole = await client.post(
            "/v1/completions",
            json={"model": relay.model, "prompt": "Once", "max_tokens": 8},
            headers={"X-Request-Id": "relay-whole"},
        )
        bad = await client.post("/v1/chat/completions", json=chat(relay.model, 4) | {"max_tokens": -1})
    assert stream.status == 200 and stream.done, stream.events[-3:]
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 8, whole.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text

    async def logged_by_the_ingress() -> dict[str, dict[str, Any]] | None:
        lines = await asyncio.to_thread(request_log_lines, _session_dir(), NAME, INGRESS.deployment_name)
        return lines if {"relay-stream", "relay-whole"} <= set(lines) else None

    lines = await wait_until(logged_by_the_ingress, 30, "both requests logged by the ingress replica")
    assert lines["relay-stream"]["status"] == 200 and lines["relay-whole"]["status"] == 200


async def test_past_serves_queue_the_ingress_answers_429_and_grpc_resource_exhausted_and_health_answers(
    relay: RunningApp, metrics_url: str
) -> None:
    """The model replica takes TAKES, Serve's queue in the ingress holds QUEUES more; past
    them the ingress refuses, a gRPC call sent meanwhile too, and ``/health`` answers.

    Sent in waves, each once the one before is where it goes: Serve checks its queue's bound
    when a request arrives but counts it queued only once its router starts on it, so requests
    that arrive together can all pass the check (in a CI run none of five was refused)."""
    async with httpx.AsyncClient(base_url=relay.url, timeout=120) as client:

        def post() -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(client.post("/v1/chat/completions", json=chat(relay.model, LONG)))

        engines = SimulatedEngines(MODEL)
        async with engines.paused():
            running_wave = [post() for _ in range(TAKES)]
            await engines.wait_until_holding(TAKES)
            queued_wave = [post() for _ in range(QUEUES)]

            async def serve_queues_them() -> bool:
                return await asyncio.to_thread(queued, metrics_url) == QUEUES

            await wait_until(serve_queues_them, 25, f"{QUEUES} requests in Serve's queue (its gauge)")
            refused = await client.post("/v1/chat/completions", json=chat(relay.model, 4))
            async with channel(relay) as grpc_channel:
                stub = pb_grpc.GenerationStub(grpc_channel)
                grpc_refused = await call(stub.ChatCompletion, grpc_chat(relay.model, 4), timeout=60)
            health = await client.get("/health")
        answers = await asyncio.gather(*running_wave, *queued_wave)
    assert [a.status_code for a in answers] == [200] * (TAKES + QUEUES), [a.text for a in answers]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded", refused.text
    assert refused.headers["retry-after"] == "1"
    assert grpc_refused.code.name == "RESOURCE_EXHAUSTED", grpc_refused.details
    assert grpc_refused.final.error.code == "overloaded" and grpc_refused.trailing["retry-after"] == "1"
    assert health.status_code == 200, health.text


def queued(metrics_url: str) -> float:
    """Requests waiting in Serve's queue for the relay app's model replica, by Serve's own gauge."""
    samples = scrape(metrics_url)
    return total(samples, "ray_serve_deployment_queued_queries", application=NAME, deployment=MODEL.deployment_name)


async def test_an_engine_death_ends_the_stream_with_an_error_and_the_replica_leaves_by_itself(
    relay: RunningApp,
) -> None:
    engines = SimulatedEngines(MODEL)
    (replica,) = await engines.replicas()
    await engines.control_all(Control.PACE, 5.0)  # the stream is still under way when the engine fails
    events: list[str] = []
    body = chat(relay.model, LONG, stream=True)
    async with httpx.AsyncClient(base_url=relay.url, timeout=120) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    if not events:  # its first chunk is out: the stream is under way
                        await engines.control(replica, Control.FAIL)
                    events.append(line[len("data: ") :])
    assert response.status_code == 200 and len(events) >= 2, events
    assert json.loads(events[-1])["error"]["code"] == "engine_failed", events[-2:]
    assert "[DONE]" not in events

    async def left_by_itself() -> bool:  # it exits (Ray: WORKER_DIED); Serve's stop would be RAY_KILL
        return await death_reason(replica) == "WORKER_DIED"

    await wait_until(left_by_itself, 60, "the dead engine's replica's own exit")
    await wait_until(lambda: _answers(relay), 120, "a new replica answering")


async def _answers(app: RunningApp) -> bool:
    async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
        return (await client.post("/v1/chat/completions", json=chat(app.model, 4))).status_code == 200
