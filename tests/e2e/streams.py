"""Requests and streams the load, dashboard and fault tests share: bodies, held streams, the engine's count."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

LONG = {"max_tokens": 900, "min_tokens": 900}  # seconds of generation for the tiny model


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}]} | extra


async def in_flight_reaches_zero(deployment, within_s: float) -> float:
    """Poll the engine's in-flight count; return how long it took to reach zero."""
    start = time.monotonic()
    while (count := await deployment.in_flight.remote()) != 0:
        elapsed = time.monotonic() - start
        assert elapsed < within_s, f"{count} requests still in the engine after {elapsed:.2f} s"
        await asyncio.sleep(0.02)  # poll interval of the condition above
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def open_streams(client: httpx.AsyncClient, body: dict, count: int) -> AsyncIterator[None]:
    """Open ``count`` streams and enter once each has its first chunk; on exit their clients leave mid-stream."""
    opened = [asyncio.Event() for _ in range(count)]
    leave = asyncio.Event()

    async def hold(started: asyncio.Event) -> None:
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                lines = response.aiter_lines()  # held: dropping it would close the stream now
                async for line in lines:
                    if line.startswith("data: {"):
                        break
                started.set()
                await leave.wait()
            # leaving the block closes the connection mid-stream
        finally:
            started.set()  # also when it failed, so the test reports why instead of hanging

    tasks = [asyncio.create_task(hold(e)) for e in opened]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), timeout=120)
        yield
    finally:
        leave.set()
        await asyncio.gather(*tasks)
