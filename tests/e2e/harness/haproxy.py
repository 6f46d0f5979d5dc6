"""Serve's HAProxy processes on this machine, watched for reloads.

Serve reloads HAProxy whenever an application's set of replicas changes by starting a new
process (``-sf``): the old one stops taking connections and keeps those it holds until they
end, or until ``RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S`` has passed since the reload. A test that
proves an answer outlives that clock needs the moment it started: the new process's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

WATCH_EVERY_S = 0.2  # a process started by a reload lives at least until the next one starts


def haproxy_starts() -> dict[int, float]:
    """The HAProxy processes now running: pid -> start time (seconds since the epoch)."""
    return {
        process.info["pid"]: process.info["create_time"]
        for process in psutil.process_iter(["pid", "name", "create_time"])
        if process.info["name"] == "haproxy"
    }


def hard_stop_after_s() -> set[int]:
    """``hard-stop-after`` in the configuration of each HAProxy process now running (read from the
    file its command line names, ``-f``): how long after a reload its old process keeps streams."""
    found = set()
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] != "haproxy":
            continue
        args = process.info["cmdline"] or []
        with contextlib.suppress(ValueError, FileNotFoundError):  # (one that ended as it was read)
            config = Path(args[args.index("-f") + 1]).read_text()
            found |= {int(seconds) for seconds in re.findall(r"^\s*hard-stop-after\s+(\d+)s\s*$", config, re.M)}
    return found


@dataclass
class Reloads:
    """Start times of the HAProxy processes seen while watching (each process once)."""

    starts: dict[int, float] = field(default_factory=dict)

    def first_after(self, moment: float) -> float | None:
        """The first reload seen after ``moment`` (seconds since the epoch), if any."""
        return min((started for started in self.starts.values() if started > moment), default=None)


@contextlib.asynccontextmanager
async def watching_reloads() -> AsyncIterator[Reloads]:
    """Record every HAProxy process that runs while the block runs."""
    reloads = Reloads()

    async def watch() -> None:
        while True:
            reloads.starts |= await asyncio.to_thread(haproxy_starts)
            await asyncio.sleep(WATCH_EVERY_S)  # a sampling interval, not a wait for a state

    watcher = asyncio.create_task(watch())
    try:
        yield reloads
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
