"""Reading Serve's view of the app from a test process joined to its cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve


async def deployment_status(handle: Any) -> Any:
    """The deployment's status overview, or None while its application is being (re)built."""
    status = await asyncio.to_thread(serve.status)
    application = status.applications.get(handle.app_name)
    return application.deployments.get(handle.deployment_name) if application else None


async def replica_states(handle: Any) -> dict[str, int]:
    deployment = await deployment_status(handle)
    return dict(deployment.replica_states) if deployment else {}


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Poll ``condition`` until it holds; return the seconds it took."""
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout_s, f"not {what} after {timeout_s:.0f} s"
        await asyncio.sleep(0.5)  # poll interval of the condition above
    return time.monotonic() - start
