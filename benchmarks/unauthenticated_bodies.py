"""What bodies sent without an API key cost a keyed client, and the ReplicaPicker, behind Serve's HAProxy.

Sends a short keyed chat one at a time, first alone, then while ``--loops`` clients each post a
body of ``--body-bytes`` without a key (empty JSON arrays, the costliest bytes to parse), again
as soon as the last is answered, in turn to the chat endpoint (401) and to a path that does not
exist (404). Reports the keyed chat's latency both ways, and the CPU seconds the pickers'
processes (read from the OS, on this machine) spent per body sent without a key: their CPU
during the bodies, less what they spend idle (measured first, ``--idle-s``) and on the keyed
chats (measured while those ran alone).

    python -m benchmarks.unauthenticated_bodies --url http://127.0.0.1:8000 --key sk-...

The app must run with API keys and Serve's HAProxy (``make serve`` with a config whose
``ingress.api_keys`` holds the key: docs/benchmarking.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import psutil

PATHS = ("/v1/chat/completions", "/not-a-route")


def picker_processes() -> list[psutil.Process]:
    """The ReplicaPicker replicas' processes here (Ray titles them ``ray::ServeReplica:<app>:ReplicaPicker``)."""
    found = []
    for process in psutil.process_iter():
        try:
            if ":ReplicaPicker" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


async def keyed_latencies(client: httpx.AsyncClient, model: str, key: str, count: int) -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    took = []
    for _ in range(count):
        started = time.perf_counter()
        response = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        took.append(time.perf_counter() - started)
        if response.status_code != 200:
            raise SystemExit(f"the keyed chat got {response.status_code}: {response.text[:200]}")
    return took


async def send_unkeyed(url: str, body: bytes, stop: asyncio.Event, statuses: dict[Any, int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        turn = 0
        while not stop.is_set():
            path = PATHS[turn % len(PATHS)]
            turn += 1
            try:
                response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
                key: Any = response.status_code
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1


def figures(took: list[float]) -> dict[str, float]:
    ordered = sorted(took)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
    }


class PickerCPU:
    """The pickers' CPU seconds and the wall seconds since the last reading."""

    def __init__(self, processes: list[psutil.Process]) -> None:
        self.processes = processes
        self.cpu, self.at = cpu_s(processes), time.monotonic()

    def since(self) -> tuple[float, float]:
        cpu, at = cpu_s(self.processes), time.monotonic()
        spent = (cpu - self.cpu, at - self.at)
        self.cpu, self.at = cpu, at
        return spent


def net_cpu_per_body(
    idle: tuple[float, float], alone: tuple[float, float], loaded: tuple[float, float], bodies: int
) -> float:
    """CPU seconds per body: the loaded phase's (cpu, wall) less idling for its wall time and the
    keyed chats' own cost (the alone phase's, less its idling)."""
    idle_rate = idle[0] / idle[1]
    keyed = alone[0] - idle_rate * alone[1]
    return (loaded[0] - idle_rate * loaded[1] - keyed) / max(bodies, 1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pickers = picker_processes()
    if not pickers:
        raise SystemExit("no ReplicaPicker process on this machine: run the app with Serve's HAProxy here")
    body = b'{"metadata": [' + b"[]," * (args.body_bytes // 3) + b"[]]}"
    async with httpx.AsyncClient(base_url=args.url, timeout=60) as client:
        await keyed_latencies(client, args.model, args.key, 3)  # warm
        meter = PickerCPU(pickers)
        await asyncio.sleep(args.idle_s)
        idle = meter.since()
        alone = await keyed_latencies(client, args.model, args.key, args.requests)
        alone_cpu = meter.since()
        statuses: dict[Any, int] = {}
        stop = asyncio.Event()
        senders = [asyncio.create_task(send_unkeyed(args.url, body, stop, statuses)) for _ in range(args.loops)]
        await asyncio.sleep(1)  # the loops under way
        loaded = await keyed_latencies(client, args.model, args.key, args.requests)
        stop.set()
        await asyncio.gather(*senders)
        loaded_cpu = meter.since()
    sent = sum(statuses.values())
    return {
        "body_bytes": len(body),
        "loops": args.loops,
        "pickers": len(pickers),
        "keyed_chat_alone": figures(alone),
        "keyed_chat_beside_unkeyed_bodies": figures(loaded),
        "unkeyed_bodies_answered": statuses,
        "picker_idle_cpu_ms_per_s": round(1000 * idle[0] / idle[1], 2),
        "picker_cpu_ms_per_unkeyed_body": round(1000 * loaded_cpu[0] / max(sent, 1), 3),
        "picker_cpu_ms_per_unkeyed_body_net": round(1000 * net_cpu_per_body(idle, alone_cpu, loaded_cpu, sent), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="glm-4-9b-chat")
    parser.add_argument("--key", required=True, help="an API key the app accepts")
    parser.add_argument("--body-bytes", type=int, default=8 * 1024 * 1024 - 4096)
    parser.add_argument("--loops", type=int, default=2, help="clients sending bodies without a key")
    parser.add_argument("--requests", type=int, default=40, help="keyed chats per phase")
    parser.add_argument("--idle-s", type=float, default=10.0, help="how long the pickers' idle CPU is measured")
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
