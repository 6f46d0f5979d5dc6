"""An engine that dies mid-answer: its streams end with an error event, and the
deployment replaces the replica. Runs with the other tests that disturb the app."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.e2e.serve_state import death_reason, replica_engines

pytestmark = pytest.mark.disruptive


async def test_engine_death_ends_streams_with_an_error_and_the_deployment_recovers(app, one_replica):
    body = {
        "model": app.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 900,
        "min_tokens": 900,
        "stream": True,
    }
    # Found first: the lookup is slow.
    by_replica = await asyncio.to_thread(replica_engines, one_replica)
    engines = [p for found in by_replica.values() for p in found]
    assert engines, "no engine process found"
    first_chunk = asyncio.Event()
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:

        async def stream() -> tuple[int, httpx.Headers, list[str]]:
            events: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()
                    elif response.status_code != 200:
                        events.append(line)
            return response.status_code, response.headers, events

        tasks = [asyncio.create_task(stream()) for _ in range(8)]
        # Killed as soon as one stream is under way: on 2 shared cores the others may
        # not have begun yet (see the README's known issues).
        await first_chunk.wait()
        for engine in engines:
            engine.send_signal(signal.SIGKILL)
        streams = await asyncio.gather(*tasks)

    # Each stream was cut and says so, or had finished in full before the kill, or was in
    # the engine before its first token and got one explicit error (engine_failed: never
    # retried), or had not reached the engine and was refused as retryable (no healthy
    # replica to send it to).
    cut = 0
    for status, headers, events in streams:
        if status == 500:
            assert json.loads(events[0])["error"]["code"] == "engine_failed", events
        elif status != 200:
            assert status in (503, 504), (status, events)
            assert status == 504 or headers["retry-after"] == "1"
        elif events[-1] == "[DONE]":
            last = json.loads(events[-2])["choices"][0]
            assert last["finish_reason"] == "length", f"a stream cut by a dead engine looks complete: {events[-3:]}"
        else:
            error = json.loads(events[-1])["error"]
            assert error["message"] and error["code"] == "engine_failed", error
            cut += 1
    assert cut >= 1, f"no stream was under way when the engine died: {[(s, e[-1:]) for s, _, e in streams]}"
    print(f"{cut} of {len(streams)} streams were cut by the engine's death, each with an error event")

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
        while True:  # the health check fails, Serve replaces the replica, answers resume
            response = await client.post(
                "/v1/chat/completions", json=body | {"stream": False, "max_tokens": 8, "min_tokens": 8}
            )
            if response.status_code == 200:
                break
            # Meanwhile: a retryable refusal, never a 500 (it reached no engine).
            assert response.status_code in (503, 504), response.text
            assert response.status_code == 504 or response.headers["retry-after"] == "1"
            assert time.monotonic() - start < 360, f"no answer {time.monotonic() - start:.0f} s after the engine died"
            await asyncio.sleep(2)  # poll interval of the condition above
    print(f"answers resumed {time.monotonic() - start:.0f} s after the engine died")
    # The replica ended its own process (serve_app.engine_watch): Ray records its worker
    # as died, where a replica Serve stopped after failed health checks is killed (RAY_KILL).
    (replica,) = by_replica
    assert await asyncio.to_thread(death_reason, replica) == "WORKER_DIED"
