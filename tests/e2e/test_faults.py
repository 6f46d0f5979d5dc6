"""An engine that dies, or hangs, mid-answer: its streams end with an error event, and the
deployment replaces the replica. Runs with the other tests that disturb the app."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import httpx
import psutil
import pytest
import yaml

from serve_app.grpc_api import generation_pb2 as pb
from serve_app.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.observability import metrics
from tests.e2e.grpc_calls import Call, call, ends_once
from tests.e2e.serve_state import a_busy_replica, death_reason, replica_engines
from tests.e2e.serve_state import wait_until as serve_wait_until
from tests.e2e.telemetry import scrape, total, wait_until

pytestmark = [pytest.mark.disruptive, pytest.mark.timeout(600)]

STREAMS = 8
GRPC_STREAMS = 4  # beside the HTTP streams in the engine-death test


def long_story(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 900,
        "min_tokens": 900,
        "stream": True,
    }


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


async def streams_through(app, hit: Callable[[], Awaitable[None]]) -> list[Stream]:
    """Start STREAMS long streams; call ``hit`` once the first is under way; each stream as it ended."""
    first_chunk = asyncio.Event()
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:

        async def stream() -> Stream:
            events: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=long_story(app.model)) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()
                    elif response.status_code != 200 and line:
                        events.append(line)
            return Stream(response.status_code, response.headers, events, time.monotonic())

        tasks = [asyncio.create_task(stream()) for _ in range(STREAMS)]
        # As soon as one stream is under way: on 2 shared cores the others may not have begun yet.
        await asyncio.wait_for(first_chunk.wait(), timeout=120)
        await hit()
        return await asyncio.gather(*tasks)


async def seconds_until_answers_resume(app) -> float:
    """Poll with short answers until one succeeds; meanwhile only retryable refusals (nothing reached an engine)."""
    start = time.monotonic()
    body = long_story(app.model) | {"stream": False, "max_tokens": 8, "min_tokens": 8}
    async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
        while (response := await client.post("/v1/chat/completions", json=body)).status_code != 200:
            assert response.status_code in (503, 504), response.text
            assert response.status_code == 504 or response.headers["retry-after"] == "1"
            assert time.monotonic() - start < 360, f"no answer {time.monotonic() - start:.0f} s later"
            await asyncio.sleep(2)  # poll interval of the condition above
    return time.monotonic() - start


async def grpc_story(app) -> Call:
    request = pb.ChatCompletionRequest(model=app.model, messages=[pb.Message(role="user", content="A long story.")])
    request.max_tokens = request.min_tokens = 900
    async with grpc.aio.insecure_channel(app.grpc_target) as channel:
        return await call(pb_grpc.GenerationStub(channel).ChatCompletion, request)


def check_grpc_calls(calls: list[Call]) -> int:
    """gRPC streams beside the HTTP ones: each ends with one final response; one the engine's death cut
    carries the error, and the call ends INTERNAL. Returns how many ended engine_failed (each an engine failure)."""
    cut = 0
    for result in calls:
        ends_once(result)
        final = result.final
        if result.code == grpc.StatusCode.OK:
            assert final.usage.completion_tokens == 900 and [c.finish_reason for c in final.choices] == ["length"]
        elif result.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            assert final.error.code in ("unavailable", "first_token_timeout", "request_timeout"), final.error
        else:
            assert (result.code, final.error.code) == (grpc.StatusCode.INTERNAL, "engine_failed"), final.error
            cut += any(c.content for r in result.responses[:-1] for c in r.choices)
    assert cut >= 1, f"no gRPC stream was under way when the engine died: {[c.code for c in calls]}"
    print(f"{cut} of {len(calls)} gRPC streams were cut by the engine's death, each with a final error response")
    return sum(1 for result in calls if result.final.error.code == "engine_failed")


def engine_failures(metrics_url: str) -> float:
    return total(scrape(metrics_url), f"ray_{metrics.ENGINE_FAILURES}_total")


async def test_engine_death_ends_streams_with_an_error_and_the_deployment_recovers(app, one_replica, metrics_url):
    counted_before = await asyncio.to_thread(engine_failures, metrics_url)
    # Found first: the lookup is slow.
    ((replica, engines),) = (await asyncio.to_thread(replica_engines, one_replica)).items()
    assert engines, "no engine process found"

    async def kill() -> None:
        """Kill the engine once its replica reports holding requests (proof they reached it).

        Frozen first (SIGSTOP): what it holds when its replica says so cannot finish before the kill.
        """
        for engine in engines:
            engine.send_signal(signal.SIGSTOP)
        assert await a_busy_replica(one_replica, {replica}, held=1, within_s=15) == replica
        for engine in engines:
            engine.send_signal(signal.SIGKILL)
        await asyncio.to_thread(lambda: [engine.wait(timeout=30) for engine in engines])

    calls = [asyncio.create_task(grpc_story(app)) for _ in range(GRPC_STREAMS)]
    streams = await streams_through(app, kill)
    calls_failed = check_grpc_calls(await asyncio.gather(*calls))

    # Each stream had finished in full before the kill, or was cut and says so (a final
    # error event), or was in the engine before its first token and got one explicit error
    # (engine_failed: never retried), or had not reached the engine and was refused as
    # retryable (no healthy replica to send it to).
    cut = 0
    for stream in streams:
        if stream.complete:
            last = json.loads(stream.events[-2])["choices"][0]
            assert last["finish_reason"] == "length", (
                f"a stream cut by a dead engine looks complete: {stream.events[-3:]}"
            )
        elif stream.status in (503, 504):
            assert stream.status == 504 or stream.headers["retry-after"] == "1"
        else:
            assert stream.error["code"] == "engine_failed", (stream.status, stream.events[-2:])
            cut += stream.status == 200
    assert cut >= 1, f"no stream was under way when the engine died: {[(s.status, s.events[-1:]) for s in streams]}"
    print(f"{cut} of {len(streams)} streams were cut by the engine's death, each with an error event")
    failed = sum(1 for stream in streams if stream.error and stream.error["code"] == "engine_failed") + calls_failed
    await asyncio.to_thread(  # each is counted once (Ray exports metrics every few seconds)
        wait_until,
        lambda: engine_failures(metrics_url) - counted_before == failed,
        60,
        f"{failed} engine failures counted in ray_{metrics.ENGINE_FAILURES}_total",
    )
    print(f"answers resumed {await seconds_until_answers_resume(app):.0f} s after the engine died")
    # The replica ended its own process (serve_app.replica.engine_watch): Ray records its worker
    # as died, where a replica Serve stopped after failed health checks is killed (RAY_KILL).
    assert await asyncio.to_thread(death_reason, replica) == "WORKER_DIED"


async def test_a_hung_engine_is_detected_its_streams_get_errors_and_a_new_replica_serves(app, one_replica):
    """The engine process is frozen (SIGSTOP) under load: it holds requests and produces nothing.

    vLLM's ``errored`` flag stays false; the replica's watchdog notices after
    ``engine_stall_timeout_s``, gives every request it holds an ``engine_failed``
    error (not a request timeout), and the replica leaves; a new one serves.
    """
    config = yaml.safe_load(app.config_path.read_text())["applications"][0]["args"]["models"][0]
    ((replica, engines),) = (await asyncio.to_thread(replica_engines, one_replica)).items()
    frozen_at: list[float] = []

    async def freeze() -> None:
        frozen_at.append(time.monotonic())
        for engine in engines:
            engine.send_signal(signal.SIGSTOP)

    try:
        streams = await streams_through(app, freeze)
    finally:
        for engine in engines:  # the replica's exit takes them along; one left frozen is the test's
            if engine.is_running() and engine.status() == psutil.STATUS_STOPPED:
                engine.kill()
    for stream in streams:
        if not stream.complete:  # (finished before the freeze)
            assert stream.error is not None and stream.error["code"] == "engine_failed", stream.events[-2:]
    slowest = max(stream.ended_at for stream in streams) - frozen_at[0]
    print(
        f"every stream ended {slowest:.1f} s after the engine froze "
        f"(engine_stall_timeout_s {config['engine_stall_timeout_s']})"
    )

    async def left_by_itself() -> bool:  # after its calls' errors went out and its engine was shut down
        return await asyncio.to_thread(death_reason, replica) == "WORKER_DIED"

    await serve_wait_until(left_by_itself, timeout_s=60, what="the hung replica's own exit")
    print(f"a new replica answered {await seconds_until_answers_resume(app):.0f} s later")
