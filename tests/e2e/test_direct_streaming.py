"""Direct streaming on the bed's cluster: the model replica answers clients, through Serve's HAProxy.

The ``direct`` variant (the bed's application with a small queue, under ``/direct``:
tests/e2e/harness/apps.py) has no ingress deployment at all: its model deployment is the
application's ingress and the ReplicaPicker is its ingress request router, so every
answer here was streamed by a model replica to HAProxy and every POST was routed by the
picker (HAProxy answers its own 503 page when the picker does not name a replica).
Checked here: the answers, the errors, a body slower than Serve's default wait, the
model list, ``/health`` (also while Serve's controller does not answer), the gRPC API, the
replica's own queue bound (429 past it, while ``/health`` still answers: it never waits behind
generation), and a stream kept alive through HAProxy until it begins. The hostile table and
large bodies, through the picker too, are test_hostile.py's (the CPU app streams the same way);
a replica whose engine died passing requests on is test_faults.py's (on ``prefix``'s two replicas);
prefix-aware routing is tests/e2e/test_prefix_routing.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray.util.state import list_actors

from serve_app.front_door.core.stream_watch import KEEPALIVE
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.front_door.telemetry import metrics
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import HEALTH_MAX_AGE_S, QUEUES, TAKES, RunningApp
from tests.e2e.harness.bodies import LONG, chat, grpc_chat
from tests.e2e.harness.grpc_calls import Multiplexed, call, channel
from tests.e2e.harness.serve_state import (
    DeploymentName,
    applications,
    in_flight,
)
from tests.e2e.harness.simulation import SimulatedEngines
from tests.e2e.harness.sse import parse_events, post_stream
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, total
from tests.hostile_requests import CHAT_PATH
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("direct")

NAME, ROUTE = "direct", "/direct"
# How long HAProxy waits for a POST's body on this path by Serve's default
# (RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S), which deploy/cluster.env raises.
SERVE_DEFAULT_BODY_WAIT_S = 5
MODEL = DeploymentName(NAME, "model-glm-4-9b-chat")


@pytest.fixture(scope="module")
def direct(variants: dict[str, RunningApp]) -> RunningApp:
    """``direct``: the bed's application with a small queue (tests/e2e/harness/apps.py)."""
    return variants[NAME]


async def test_the_model_replica_is_the_applications_ingress_with_the_picker_beside_it(direct: RunningApp) -> None:
    deployments = (await applications())[NAME].deployments
    assert set(deployments) == {MODEL.deployment_name, "ReplicaPicker"}, set(deployments)


async def test_streams_and_whole_answers_come_from_the_model_replica(direct: RunningApp) -> None:
    async with httpx.AsyncClient(base_url=direct.url, timeout=60) as client:
        stream = await post_stream(client, "/v1/chat/completions", chat(direct.model, 16, stream=True))
        assert stream.status == 200 and stream.done, stream.events[-3:]
        text = [c["choices"][0]["delta"].get("content", "") for c in stream.chunks if c.get("choices")]
        assert stream.chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("usage" in chunk for chunk in stream.chunks)  # not asked for
        assert "".join(text)
        whole = await client.post("/v1/completions", json={"model": direct.model, "prompt": "Once", "max_tokens": 8})
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 8
        models = await client.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == [direct.model]


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (b"not json", 400, "not valid JSON"),
        (json.dumps({"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "nobody"),
        (
            json.dumps(
                {"model": "glm-4-9b-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}
            ).encode(),
            400,
            "max_tokens",
        ),
    ],
)
async def test_bad_requests_get_the_openai_error_that_names_the_problem(
    direct: RunningApp, body: bytes, status: int, names: str
) -> None:
    async with httpx.AsyncClient(base_url=direct.url, timeout=60) as client:
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert names in error["message"] or error["param"] == names, error


async def test_a_client_slower_to_send_its_body_than_serves_default_wait_is_answered(direct: RunningApp) -> None:
    """HAProxy holds a POST here until its body has come, then hands it to the picker. Serve's
    default bound on that wait (5 s) answered a slow upload with HAProxy's own 408 page (seen:
    a loaded client of test_autoscale's); deploy/cluster.env gives it ingress.body_timeout_s.
    The client here sends its headers, then its body one second past
    Serve's default."""
    body = json.dumps(chat(direct.model, 4)).encode()

    async def after_serves_default_wait() -> AsyncIterator[bytes]:
        await asyncio.sleep(SERVE_DEFAULT_BODY_WAIT_S + 1)  # the slow client itself, not a wait for a condition
        yield body

    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    async with httpx.AsyncClient(base_url=direct.url, timeout=60) as client:
        response = await client.post(CHAT_PATH, content=after_serves_default_wait(), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


async def test_health_is_answered_before_serves_work_for_a_request(direct: RunningApp) -> None:
    """Behind HAProxy the model replica answers ``GET /health`` as soon as its own HTTP server has
    read it (``serve_internals.answer_probes_first``): the readiness answer as ever, and no line in
    Serve's access log of the replica, where the model list asked for after it has one."""
    probe_id, listed_id = f"probe-{uuid.uuid4().hex}", f"models-{uuid.uuid4().hex}"
    async with httpx.AsyncClient(base_url=direct.url, timeout=30) as client:
        health = await client.get("/health", headers={"X-Request-Id": probe_id})
        models = await client.get("/v1/models", headers={"X-Request-Id": listed_id})
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert models.status_code == 200, models.text
    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path(), "logs", "serve")

    def after_the_model_list() -> str | None:
        """Every line of the app's replicas' Serve logs, once the model list's access line is there."""
        text = "".join(path.read_text(errors="replace") for path in logs.glob(f"replica_{NAME}_*.log"))
        return text if listed_id in text else None

    written = await wait_until(after_the_model_list, 30, "the model list's access line")
    assert probe_id not in written


async def test_the_grpc_api_is_answered_by_the_model_replica(direct: RunningApp) -> None:
    async with channel(direct) as grpc_channel:
        result = await call(pb_grpc.GenerationStub(grpc_channel).ChatCompletion, grpc_chat(direct.model, 8), timeout=60)
    assert result.code.name == "OK", result.details
    assert result.final.final and result.final.usage.completion_tokens == 8


async def test_without_serves_controller_requests_are_served_and_health_stays_green(direct: RunningApp) -> None:
    """Serve's controller stopped (SIGSTOP: to a replica, its head pod's loss or a stall looks the
    same): once its last word is HEALTH_MAX_AGE_S old, ``/health`` answers 200 from the replica's own
    engine with ``controller_reachable`` false, and the gRPC health service SERVING, while a chat
    is answered (the data plane needs no controller). The controller back, its word counts again.
    (That a failed engine then makes it 503 is the unit tests': tests/unit/front_door/test_readiness.py.)"""
    filters = [("class_name", "=", "ServeController"), ("state", "=", "ALIVE")]
    (controller,) = await asyncio.to_thread(list_actors, filters=filters)
    async with httpx.AsyncClient(base_url=direct.url, timeout=60) as client:
        os.kill(controller.pid, signal.SIGSTOP)
        try:
            alone = await wait_until(
                lambda: health_if(client, reachable=False), HEALTH_MAX_AGE_S + 30, "/health without the controller"
            )
            answer = await client.post(CHAT_PATH, json=chat(direct.model, 4))
            async with channel(direct) as grpc_channel:
                checked = await health_pb2_grpc.HealthStub(grpc_channel).Check(health_pb2.HealthCheckRequest())
        finally:
            os.kill(controller.pid, signal.SIGCONT)
        assert alone.status_code == 200, alone.text
        # (age_s is rounded to the millisecond: just past the bound reads as the bound)
        assert alone.json()["models"] == {direct.model: True} and alone.json()["age_s"] >= HEALTH_MAX_AGE_S
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        back = await wait_until(lambda: health_if(client, reachable=True), 60, "/health with the controller's word")
        assert back.status_code == 200, back.text


async def health_if(client: httpx.AsyncClient, reachable: bool) -> httpx.Response | None:
    """``/health``'s answer if it says the controller is (or is not) ``reachable``."""
    answer = await client.get("/health")
    return answer if answer.json().get("controller_reachable") is reachable else None


async def test_past_its_queue_a_replica_answers_429_and_grpc_resource_exhausted_and_health_still_answers(
    direct: RunningApp, metrics_url: str
) -> None:
    """HTTP requests and gRPC calls hold places from one count: with HTTP holding them all (the
    engine paused), a request is refused at once with 429 and the retry hint, a call with gRPC's
    status for it and one final response, ``/health`` still answers, every held request then
    completes, and each refusal is counted as rejected because the queue was full."""
    limit = TAKES + QUEUES
    labels = {"application": direct.name, "model": direct.model, "reason": "overloaded"}
    rejected_before = rejected(metrics_url, **labels)
    async with httpx.AsyncClient(base_url=direct.url, timeout=120) as client:
        async with SimulatedEngines(MODEL).paused():
            held = [
                asyncio.create_task(client.post("/v1/chat/completions", json=chat(direct.model, LONG)))
                for _ in range(limit)
            ]

            async def all_held() -> bool:
                return await in_flight(MODEL) == limit

            await wait_until(all_held, 30, f"{limit} requests held by the paused engine")
            refused = await client.post("/v1/chat/completions", json=chat(direct.model, 4))
            health = await client.get("/health")
            async with channel(direct) as grpc_channel:
                stub = pb_grpc.GenerationStub(grpc_channel)
                grpc_refused = await call(stub.ChatCompletion, grpc_chat(direct.model, 4), timeout=60)
        answers = await asyncio.gather(*held)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert (refused.json()["error"]["code"], refused.json()["error"]["type"]) == ("overloaded", "rate_limit_error")
    assert health.status_code == 200, health.text
    assert grpc_refused.code.name == "RESOURCE_EXHAUSTED", grpc_refused.details
    assert [(r.final, r.error.code) for r in grpc_refused.responses] == [(True, "overloaded")]
    assert (grpc_refused.trailing["retry-after"], grpc_refused.trailing["grpc-retry-pushback-ms"]) == ("1", "1000")
    assert [a.status_code for a in answers] == [200] * limit, [a.text for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == LONG for a in answers)
    await wait_until(
        lambda: rejected(metrics_url, **labels) - rejected_before >= 2,
        60,
        "the rejected-requests counter grows by 2",
        every_s=SCRAPE_EVERY_S,
    )
    assert rejected(metrics_url, **labels) - rejected_before == 2  # the 429 and the RESOURCE_EXHAUSTED


async def test_a_request_on_a_multiplexed_call_past_the_replicas_bound_is_refused_alone(direct: RunningApp) -> None:
    """The requests of one Stream call hold the replica's places one each: with the call's first
    TAKES + QUEUES held (the engine paused), its next one gets its own RESOURCE_EXHAUSTED final
    response, and the held ones complete on the same call, which ends OK."""
    limit = TAKES + QUEUES
    engines = SimulatedEngines(MODEL)
    async with channel(direct) as grpc_channel:
        stream = Multiplexed(pb_grpc.GenerationStub(grpc_channel))
        async with engines.paused():
            for n in range(limit):
                await stream.send(pb.StreamRequest(id=f"held-{n}", chat=grpc_chat(direct.model, 4)))
            await engines.wait_until_holding(limit)
            await stream.send(pb.StreamRequest(id="past", chat=grpc_chat(direct.model, 4)))
            refused = await stream.ended("past")
        code, details = await stream.close()
    assert code.name == "OK", details
    assert (refused.final, refused.error.status, refused.error.code) == (True, 8, "overloaded")  # RESOURCE_EXHAUSTED
    for n in range(limit):
        final = stream.of(f"held-{n}")[-1]
        assert final.final and not final.HasField("error") and final.usage.completion_tokens == 4


def rejected(metrics_url: str, **labels: str) -> float:
    return total(scrape(metrics_url), f"ray_{metrics.REJECTED}_total", **labels)


async def test_a_replica_counts_its_places_in_engine_sequences(direct: RunningApp) -> None:
    """A request of n choices holds n of the replica's places (TAKES + QUEUES = 4), not one: with
    one of n 3 held, one of n 2 is refused (429 overloaded) and reaches no engine, one of n 1 is
    taken; both held ones complete with their choices."""
    engines = SimulatedEngines(MODEL)
    async with httpx.AsyncClient(base_url=direct.url, timeout=120) as client:
        async with engines.paused():
            three = asyncio.create_task(client.post(CHAT_PATH, json=chat(direct.model, 4, n=3)))
            await engines.wait_until_holding(3)
            refused = await client.post(CHAT_PATH, json=chat(direct.model, 4, n=2))
            one = asyncio.create_task(client.post(CHAT_PATH, json=chat(direct.model, 4)))
            await engines.wait_until_holding(4)
        answers = await asyncio.gather(three, one)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert [len(a.json()["choices"]) for a in answers] == [3, 1]


async def test_a_stream_not_yet_begun_gets_keepalives_through_haproxy_and_ends_when_its_client_leaves(
    direct: RunningApp,
) -> None:
    """With the engine paused, a stream gets its headers and an SSE comment every KEEPALIVE_S (1 s)
    through HAProxy, then, once the engine runs, its whole answer (which a client reading SSE as
    OpenAI's SDK does reads past the comments); a second one whose client leaves during its
    keep-alives leaves the engine."""
    engines = SimulatedEngines(MODEL)
    body = chat(direct.model, 4) | {"stream": True}
    async with httpx.AsyncClient(base_url=direct.url, timeout=60) as client:
        async with engines.paused(), client.stream("POST", CHAT_PATH, json=body) as response:
            assert response.status_code == 200, await response.aread()
            received, texts = "", response.aiter_text()
            async for text in texts:
                received += text
                if received.count(KEEPALIVE) >= 2:
                    break
            await engines.control_all(Control.RESUME)
            async for text in texts:
                received += text
        async with engines.paused():
            async with client.stream("POST", CHAT_PATH, json=body) as left:
                await engines.wait_until_holding(1)  # (its answer is in the engine, not yet begun)
                async for text in left.aiter_text():
                    assert text == KEEPALIVE, text
                    break  # (the client leaves while the answer has not begun)
            await engines.wait_until_holding(0)
    kept, _, answer = received.rpartition(KEEPALIVE)
    assert set(kept.split("\n\n")) <= {KEEPALIVE.strip(), ""}, received
    events = parse_events(answer)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length", answer
