"""Streams held open by a test: each has its first chunk, then its client leaves when the test says."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from tests.waiting import wait_until


@contextlib.asynccontextmanager
async def open_streams(
    client: httpx.AsyncClient, body: dict, count: int, path: str = "/v1/chat/completions"
) -> AsyncIterator[None]:
    """Open ``count`` streams and enter once each has its first chunk; on exit their clients leave mid-stream."""
    opened = [asyncio.Event() for _ in range(count)]
    leave = asyncio.Event()

    async def hold(started: asyncio.Event) -> None:
        try:
            async with client.stream("POST", path, json=body) as response:
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
        await wait_until(lambda: all(e.is_set() for e in opened), 120, f"{count} streams under way", every_s=0.02)
        for task in tasks:
            if task.done():
                task.result()  # a stream that failed says why
        yield
    finally:
        leave.set()
        await asyncio.gather(*tasks)
