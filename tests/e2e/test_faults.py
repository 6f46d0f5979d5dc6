"""An engine that dies, or hangs, mid-answer: its streams end with an error, and a new replica serves.

On the bed, the simulated engine is made to fail (vLLM's own engine-dead error path, which a
dead engine-core process takes) or to hang, at the moment the test chooses: streams under way
(their first tokens read, the engine at a fifth of its pace) and requests still waiting for
their first token (the engine paused). One canary on the CPU app kills the real engine's
process, the event the simulated failure stands for; it replaces the CPU app's replica, so it
runs last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import httpx
import pytest
import ray

from serve_app.front_door import metrics
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import BED_REPLACES_S, BED_STALL_TIMEOUT_S, RunningApp
from tests.e2e.harness.bodies import LONG, chat, grpc_chat
from tests.e2e.harness.grpc_calls import Call, channel, ends_once
from tests.e2e.harness.serve_state import death_reason, replica_engines, request_log_lines, single_replica
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, total
from tests.waiting import wait_until

STREAMS = 8
GRPC_STREAMS = 4
WAITING = 2  # sent once the engine is paused: in the engine, before their first token


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
    app: RunningApp, engines, act: Callable[[], Awaitable[None]]
) -> tuple[list[Stream], list[Call], list[Stream]]:
    """STREAMS HTTP and GRPC_STREAMS gRPC streams under way, then WAITING more held by the paused
    engine before their first token; then ``act``; each stream as it ended."""
    started = [asyncio.Event() for _ in range(STREAMS + GRPC_STREAMS)]
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        under_way = [asyncio.create_task(stream(client, app, e)) for e in started[:STREAMS]]
        grpc_calls = [asyncio.create_task(grpc_stream(app, e)) for e in started[STREAMS:]]
        await wait_until(lambda: all(e.is_set() for e in started), 60, "every stream under way", every_s=0.02)
        await engines.control_all(Control.PAUSE)
        waiting = [asyncio.create_task(stream(client, app)) for _ in range(WAITING)]
        await engines.wait_until_holding(STREAMS + GRPC_STREAMS + WAITING)
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


async def test_engine_death_ends_each_request_once_with_an_error_and_a_new_replica_serves(bed, metrics_url):
    app = bed.app
    counted_before = await asyncio.to_thread(engine_failures, metrics_url, app)
    (replica,) = await bed.engines.replicas()
    await bed.engines.control_all(Control.PACE, 5.0)

    async def fail() -> None:
        await bed.engines.control(replica, Control.FAIL)

    streams, grpc_calls, waiting = await streams_through(app, bed.engines, fail)
    check_cut(streams, grpc_calls, waiting)
    failed = STREAMS + GRPC_STREAMS + WAITING
    await wait_until(  # each is counted once (Ray exports metrics every few seconds)
        lambda: engine_failures(metrics_url, app) - counted_before >= failed,
        60,
        f"{failed} engine failures counted in ray_{metrics.ENGINE_FAILURES}_total",
        every_s=SCRAPE_EVERY_S,
    )
    assert engine_failures(metrics_url, app) - counted_before == failed
    print(f"{failed} requests held by the failed engine each got one engine_failed error")
    print(f"answers resumed {await seconds_until_answers_resume(app):.1f} s after the engine died")
    await wait_until(lambda: left(replica), BED_REPLACES_S, "the failed engine's replica gone")


async def kill_the_engine_under_streams(app: RunningApp, deployment) -> tuple[str, list[Stream]]:
    """Start STREAMS long streams on the CPU app's one replica; SIGKILL its engine-core process
    once the first chunk arrives; return the replica's actor id and how each stream ended."""
    ((replica, engines),) = (await asyncio.to_thread(replica_engines, deployment)).items()
    assert engines, "no engine process found"
    first_chunk = asyncio.Event()
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        streams = [asyncio.create_task(stream(client, app, first_chunk)) for _ in range(STREAMS)]
        await wait_until(first_chunk.is_set, 120, "a stream under way", every_s=0.01)
        # That stream has 899 of its 900 tokens to go, unless delivery lags the engine.
        for engine in engines:
            engine.send_signal(signal.SIGKILL)
        return replica, list(await asyncio.gather(*streams))


async def test_a_hung_engine_is_detected_its_requests_get_errors_and_a_new_replica_serves(bed):
    """The engine stops producing, with no sign of life, while it holds requests. vLLM's
    ``errored`` flag stays false; the replica's watchdog notices after ``engine_stall_timeout_s``,
    gives every request it holds an ``engine_failed`` error (not a time-out), and the replica
    leaves (see :func:`left`); a new one serves."""
    app = bed.app
    (replica,) = await bed.engines.replicas()
    await bed.engines.control_all(Control.PACE, 5.0)
    hung_at: list[float] = []

    async def hang() -> None:
        hung_at.append(time.monotonic())
        await bed.engines.control(replica, Control.HANG)

    streams, grpc_calls, waiting = await streams_through(app, bed.engines, hang)
    check_cut(streams, grpc_calls, waiting)
    slowest = max(s.ended_at for s in streams + waiting) - hung_at[0]
    print(f"every request ended {slowest:.1f} s after the engine hung (engine_stall_timeout_s {BED_STALL_TIMEOUT_S})")

    # (after its calls' errors went out)
    await wait_until(lambda: left(replica), BED_REPLACES_S, "the hung replica gone")
    print(f"a new replica answered {await seconds_until_answers_resume(app):.1f} s later")


@pytest.mark.disruptive  # the CPU app's replica is replaced (a CPU engine loads for a minute)
async def test_a_real_engine_process_that_dies_ends_its_streams_with_an_error_and_is_replaced(app, one_replica):
    """The canary for the simulated failure: the real engine-core process is killed (SIGKILL)
    while it generates. Streams it was generating end with an ``engine_failed`` error event,
    Serve replaces the replica, and a new replica answers."""
    for attempt in (1, 2):
        replica, results = await kill_the_engine_under_streams(app, one_replica)
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
    print(f"answers resumed {await seconds_until_answers_resume(app):.0f} s after the engine died")
    await wait_until(lambda: left(replica), 60, "the dead engine's replica gone")
    # Each request the dead engine held was answered once (never sent to another replica).
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()
    logged = await asyncio.to_thread(request_log_lines, session_dir, app.name)
    failed = [line for line in logged.values() if line.get("error") == "engine_failed"]
    assert failed and all(line["attempts"] == 1 for line in failed), failed
