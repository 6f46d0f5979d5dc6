"""An engine that dies, or hangs, mid-answer: what it held ends with an error, and the rest is served.

The simulated engine is made to fail (vLLM's own engine-dead error path, which a dead
engine-core process takes) or to hang, at the moment the test chooses: streams under way
(their first tokens read, the engine at a fifth of its pace) and requests still waiting for
their first token (the engine paused). The death is on ``prefix``'s two model replicas (what
its replica is sent next goes on to the other), the hang on the bed, as is a ReplicaPicker's
death (SIGKILL: HAProxy asks the node's other picker). One canary on the CPU app kills the real
engine's process, the event the simulated failure stands for; it leaves
the CPU app without an engine, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import ray
from ray import serve
from ray.util.state import list_actors

from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.front_door.telemetry import metrics
from serve_app.serve_internals import pick_replica
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import BED_REPLACES_S, BED_STALL_TIMEOUT_S, RunningApp
from tests.e2e.harness.bodies import LONG, chat, grpc_chat
from tests.e2e.harness.grpc_calls import Call, channel, ends_once
from tests.e2e.harness.serve_state import (
    DeploymentName,
    death_reason,
    replica_engines,
    request_log_lines,
    running_replica_actors,
    serve_replica_id,
    single_replica,
)
from tests.e2e.harness.simulation import SimulatedEngines, ready_bed
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, total
from tests.hostile_requests import CHAT_PATH
from tests.waiting import wait_until

STREAMS = 8
GRPC_STREAMS = 4
WAITING = 2  # sent once the engine is paused: in the engine, before their first token
PASSED_ON = 16  # sent to the failed engine's replica while it is still listed


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    events: list[str]  # `data:` payloads, or the lines of an error body
    ended_at: float

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.events[-1] == "[DONE]"

    @property
    def error(self) -> dict | None:
        return json.loads(self.events[-1]).get("error") if self.events and not self.complete else None


async def stream(client: httpx.AsyncClient, app: RunningApp, started: asyncio.Event | None = None) -> Stream:
    """One long stream, read whole; ``started`` is set once its first chunk is in."""
    events: list[str] = []
    body = chat(app.model, LONG, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
            elif response.status_code != 200 and line:
                events.append(line)
    return Stream(response.status_code, response.headers, events, time.monotonic())


async def grpc_stream(app: RunningApp, started: asyncio.Event) -> Call:
    async with channel(app) as grpc_channel:
        stub = pb_grpc.GenerationStub(grpc_channel)
        rpc = stub.ChatCompletion(grpc_chat(app.model, LONG))

        responses = []
        started_at = time.monotonic()
        try:
            async for response in rpc:
                responses.append(response)
                if not response.final:  # the engine's first output came (its text may still be empty)
                    started.set()
        except grpc.aio.AioRpcError:
            pass
        trailing = dict(await rpc.trailing_metadata() or ())
        return Call(responses, await rpc.code(), await rpc.details(), trailing, time.monotonic() - started_at)


async def streams_through(
    app: RunningApp,
    engines: SimulatedEngines,
    replica: str,
    act: Callable[[], Awaitable[None]],
    url: str | None = None,
    grpc_streams: int = GRPC_STREAMS,
) -> tuple[list[Stream], list[Call], list[Stream]]:
    """STREAMS HTTP streams (to ``url``: the app's, or one replica's own port as HAProxy sends
    them) and ``grpc_streams`` gRPC streams under way on ``replica``, then WAITING more held by its
    paused engine before their first token; then ``act``; each stream as it ended."""
    started = [asyncio.Event() for _ in range(STREAMS + grpc_streams)]
    async with httpx.AsyncClient(base_url=url or app.url, timeout=120) as client:
        under_way = [asyncio.create_task(stream(client, app, e)) for e in started[:STREAMS]]
        grpc_calls = [asyncio.create_task(grpc_stream(app, e)) for e in started[STREAMS:]]
        await wait_until(lambda: all(e.is_set() for e in started), 60, "every stream under way", every_s=0.02)
        await engines.control(replica, Control.PAUSE)
        waiting = [asyncio.create_task(stream(client, app)) for _ in range(WAITING)]
        await engines.wait_until_holding(STREAMS + grpc_streams + WAITING)
        await act()
        return await asyncio.gather(*under_way), await asyncio.gather(*grpc_calls), await asyncio.gather(*waiting)


def engine_failures(metrics_url: str, app: RunningApp) -> float:
    return total(scrape(metrics_url), f"ray_{metrics.ENGINE_FAILURES}_total", application=app.name)


async def seconds_until_answers_resume(app: RunningApp) -> float:
    """Poll with short answers until one succeeds; meanwhile only retryable refusals (nothing reached an engine)."""
    start = time.monotonic()

    async def answered() -> bool:
        async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
            response = await client.post("/v1/chat/completions", json=chat(app.model, 8))
        if response.status_code != 200:
            assert response.status_code in (503, 504), response.text
            assert response.status_code == 504 or response.headers["retry-after"] == "1"
        return response.status_code == 200

    await wait_until(answered, 360, "an answer after the engine's death", every_s=1)
    return time.monotonic() - start


async def left(replica: str) -> bool:
    """Whether the replica whose engine failed is gone: it stays, passing on what HAProxy still
    sends it, until Serve, whose health check of it fails, stops it."""
    return await death_reason(replica) is not None


def check_cut(streams: list[Stream], grpc_calls: list[Call], waiting: list[Stream]) -> None:
    """Streams under way (their first chunk sent: the engine's first output for them) end with
    one engine_failed error event (gRPC: one final response and INTERNAL); those still waiting
    for their first token get a 500 engine_failed instead."""
    for s in streams:
        assert s.status == 200 and s.error is not None, (s.status, s.events[-2:])
        assert s.error["code"] == "engine_failed", s.events[-2:]
        assert len(s.events) >= 2 and "error" not in json.loads(s.events[0])  # it had started
    for result in grpc_calls:
        ends_once(result)
        assert (result.code, result.final.error.code) == (grpc.StatusCode.INTERNAL, "engine_failed")
        assert len(result.responses) >= 2  # it had started
    for s in waiting:
        assert s.status == 500 and json.loads(s.events[0])["error"]["code"] == "engine_failed", (s.status, s.events)


@pytest.mark.applications("prefix")
async def test_an_engine_death_ends_what_it_held_with_an_error_and_its_replica_passes_on_the_rest(
    variants: dict[str, RunningApp], metrics_url: str
) -> None:
    """On ``prefix``'s two model replicas, one engine fails while it holds streams under way and
    requests waiting for their first token, sent to its replica's own HTTP port as HAProxy sends
    them: each ends once with an ``engine_failed`` error and is counted once. The replica stays in
    HAProxy's and the picker's lists until Serve, whose health check of it fails, stops it;
    requests sent to it meanwhile are not refused but passed on to the other replica (200 each,
    its request log still written), and then it leaves. (That Serve starts a replacement is the
    hung engine's test's.)"""
    two = await ready_bed(variants["prefix"], replicas=2)
    app, model, engines = two.app, two.model, two.engines
    counted_before = await asyncio.to_thread(engine_failures, metrics_url, app)
    chat_handle = serve.get_deployment_handle(model.deployment_name, app.name).options(method_name="chat")
    endpoint = await pick_replica(chat_handle)  # the picker's own call names one
    by_serve_id = {await serve_replica_id(actor): actor for actor in await engines.replicas()}
    dead_id = endpoint.replica_id.rsplit("#", 1)[-1]
    dead = by_serve_id[dead_id]
    # The replica's own HTTP server listens on http_options.host, as the app's origin does
    # (Serve names the node's address; on this one-node cluster HAProxy reaches it there).
    replica_url = f"http://{httpx.URL(app.origin).host}:{endpoint.port}{app.route_prefix}"
    await engines.control(dead, Control.PACE, 5.0)

    async def fail() -> None:
        await engines.control(dead, Control.FAIL)

    streams, _, waiting = await streams_through(app, engines, dead, fail, url=replica_url, grpc_streams=0)
    check_cut(streams, [], waiting)
    failed = STREAMS + WAITING
    await wait_until(  # each is counted once (Ray exports metrics every few seconds)
        lambda: engine_failures(metrics_url, app) - counted_before >= failed,
        60,
        f"{failed} engine failures counted in ray_{metrics.ENGINE_FAILURES}_total",
        every_s=SCRAPE_EVERY_S,
    )
    assert engine_failures(metrics_url, app) - counted_before == failed

    async with httpx.AsyncClient(base_url=replica_url, timeout=60) as client:

        async def one(i: int) -> tuple[str, httpx.Response]:
            request_id = f"passed-on-{dead_id}-{i}"
            response = await client.post(CHAT_PATH, json=chat(app.model, 4), headers={"X-Request-Id": request_id})
            return request_id, response

        answers = await asyncio.gather(*(one(i) for i in range(PASSED_ON)))
    refused = [(r.status_code, r.text) for _, r in answers if r.status_code != 200]
    assert not refused, refused
    assert all(r.json()["usage"]["completion_tokens"] == 4 for _, r in answers)
    sent = [request_id for request_id, _ in answers]
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()

    async def lines() -> dict[str, Any]:
        return await asyncio.to_thread(request_log_lines, session_dir, app.name, model.deployment_name, dead_id)

    async def all_logged() -> bool:  # (a line is written as its request's record ends, after the answer)
        return set(sent) <= set(await lines())

    await wait_until(all_logged, 30, "the dead replica's log line of every request")
    logged = await lines()
    not_200 = {request_id: logged[request_id]["status"] for request_id in sent if logged[request_id]["status"] != 200}
    assert not not_200, not_200
    print(f"{failed} requests held by the failed engine each got one engine_failed error; {PASSED_ON} sent after")
    await wait_until(lambda: left(dead), BED_REPLACES_S, "the failed engine's replica gone")


@pytest.mark.applications("prefix")
async def test_a_replica_process_killed_mid_stream_cuts_the_connection_never_a_clean_end(
    variants: dict[str, RunningApp],
) -> None:
    """A model replica's process killed (SIGKILL: an out-of-memory kill, a lost node) while it
    streams an answer through HAProxy: the client's connection is cut, so its library raises a
    transport error; the stream has no ``[DONE]`` and no error event, nothing that reads as a
    complete answer. (HAProxy retries only a connection that failed before the request was sent:
    docs/api-behaviour.md.) On ``prefix`` after the death above, its last test: the replacement
    Serve starts for this replica is not waited for."""
    model = DeploymentName("prefix", variants["prefix"].model_deployment)
    app, engines = variants["prefix"], SimulatedEngines(model)
    serving = await wait_until(lambda: running_replica_actors(model), 60, "a running replica on prefix")
    for replica in serving:  # slow enough that the stream is still under way when its replica dies
        await engines.control(replica, Control.PACE, 20.0)
    events: list[str] = []
    first_chunk = asyncio.Event()

    async def read() -> None:
        async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
            body = chat(app.model, LONG, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()

    reading = asyncio.create_task(read())
    await wait_until(first_chunk.is_set, 60, "the stream under way", every_s=0.02)
    states = {replica: await engines.control(replica, Control.STATE) for replica in serving}
    (streaming,) = [replica for replica, state in states.items() if state.holds]
    (actor,) = await asyncio.to_thread(list_actors, filters=[("actor_id", "=", streaming)])
    os.kill(actor.pid, signal.SIGKILL)
    with pytest.raises(httpx.TransportError):
        await reading
    assert events and "[DONE]" not in events, events[-2:]
    assert not any("error" in json.loads(event) for event in events), events[-2:]
    print(f"{len(events)} chunks read before the cut; the client's library raised a transport error")


async def kill_the_engine_under_streams(app: RunningApp, deployment) -> list[Stream]:
    """Start STREAMS long streams on the CPU app's one replica; SIGKILL its engine-core process
    once the first chunk arrives; return how each stream ended."""
    (engines,) = (await asyncio.to_thread(replica_engines, deployment)).values()  # its one replica
    assert engines, "no engine process found"
    first_chunk = asyncio.Event()
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        streams = [asyncio.create_task(stream(client, app, first_chunk)) for _ in range(STREAMS)]
        await wait_until(first_chunk.is_set, 120, "a stream under way", every_s=0.01)
        # That stream has 899 of its 900 tokens to go, unless delivery lags the engine.
        for engine in engines:
            engine.send_signal(signal.SIGKILL)
        return list(await asyncio.gather(*streams))


async def test_a_hung_engine_is_detected_its_requests_get_errors_and_a_new_replica_serves(bed):
    """The engine stops producing, with no sign of life, while it holds requests. vLLM's
    ``errored`` flag stays false; the replica's watchdog notices after ``engine_stall_timeout_s``,
    gives every request it holds an ``engine_failed`` error (not a time-out), and the replica
    leaves (see :func:`left`); a new one serves."""
    app = bed.app
    (replica,) = await bed.engines.replicas()
    await bed.engines.control(replica, Control.PACE, 5.0)
    hung_at: list[float] = []

    async def hang() -> None:
        hung_at.append(time.monotonic())
        await bed.engines.control(replica, Control.HANG)

    streams, grpc_calls, waiting = await streams_through(app, bed.engines, replica, hang)
    check_cut(streams, grpc_calls, waiting)
    slowest = max(s.ended_at for s in streams + waiting) - hung_at[0]
    print(f"every request ended {slowest:.1f} s after the engine hung (engine_stall_timeout_s {BED_STALL_TIMEOUT_S})")

    # (after its calls' errors went out)
    await wait_until(lambda: left(replica), BED_REPLACES_S, "the hung replica gone")
    print(f"a new replica answered {await seconds_until_answers_resume(app):.1f} s later")


PICKER_BURST = 24  # requests sent at once right after a picker's death, while HAProxy still lists it


async def test_a_pickers_death_costs_no_request_haproxy_asks_the_other(bed) -> None:
    """The bed's two ReplicaPicker replicas (two a node, as shipped): one killed (SIGKILL), then
    requests sent at once while HAProxy still lists it: its Lua action, in turn over the node's
    pickers, finds the dead one's port closed and asks the other, so every request is answered
    whole (with one picker each would get HAProxy's 503). Serve then starts a replacement, which
    the test waits for: the bed keeps its shape for the tests after."""
    picker = DeploymentName(bed.app.name, "ReplicaPicker")

    async def two_running() -> set[str] | None:
        replicas = await running_replica_actors(picker)
        return replicas if len(replicas) == 2 else None

    before = await wait_until(two_running, 60, "the bed's two pickers running")
    victim = sorted(before)[0]
    (actor,) = await asyncio.to_thread(list_actors, filters=[("actor_id", "=", victim)])

    async def one(client: httpx.AsyncClient) -> tuple[int, str | None]:
        response = await client.post(CHAT_PATH, json=chat(bed.app.model, 4))
        finish = response.json()["choices"][0]["finish_reason"] if response.status_code == 200 else response.text
        return response.status_code, finish

    async with httpx.AsyncClient(base_url=bed.app.url, timeout=60) as client:
        assert await one(client) == (200, "length")
        os.kill(actor.pid, signal.SIGKILL)
        answers = await asyncio.gather(*(one(client) for _ in range(PICKER_BURST)))
    assert answers == [(200, "length")] * PICKER_BURST, answers

    async def replaced() -> bool:
        replicas = await running_replica_actors(picker)
        return len(replicas) == 2 and victim not in replicas

    await wait_until(replaced, BED_REPLACES_S, "the dead picker replaced")


@pytest.mark.last  # the CPU app is left without an engine: nothing waits for its new one
async def test_a_real_engine_process_that_dies_ends_its_streams_with_an_error_event(app, one_replica):
    """The canary for the simulated failure: the real engine-core process is killed (SIGKILL)
    while it generates. Streams it was generating end with an ``engine_failed`` error event, each
    request once. (That Serve then replaces the replica is proven on the bed, by the hung engine's
    test: a CPU engine's start would cost the suite a minute of both cores for nothing more.)"""
    for attempt in (1, 2):
        results = await kill_the_engine_under_streams(app, one_replica)
        cut = 0
        for s in results:
            if s.complete:  # generated in full before the kill (delivery can lag generation)
                continue
            if s.status in (503, 504):  # refused before reaching the engine: retryable
                assert s.status == 504 or s.headers["retry-after"] == "1"
            else:
                assert s.error is not None and s.error["code"] == "engine_failed", (s.status, s.events[-2:])
                cut += s.status == 200
        if cut:
            break
        # Every stream was generated before the kill landed: nothing was cut, so nothing was
        # shown. Once the dead engine's replica is replaced, once more.
        assert attempt == 1, [(s.status, s.events[-1:]) for s in results]
        await single_replica(one_replica)
    print(f"{cut} of {STREAMS} streams were cut by the engine's death, each with an error event")
    # Each request the dead engine held was answered once (never sent to another replica). The
    # replica writes a request's line as its record ends, just after the client read its last event.
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()

    async def logged_as_failed() -> list[dict] | None:
        logged = await asyncio.to_thread(request_log_lines, session_dir, app.name)
        failed = [line for line in logged.values() if line.get("error") == "engine_failed"]
        return failed if len(failed) >= cut else None

    failed = await wait_until(logged_as_failed, 30, f"the {cut} cut requests logged as engine_failed")
    assert all(line["attempts"] == 1 for line in failed), failed
