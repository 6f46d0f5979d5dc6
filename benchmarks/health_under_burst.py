"""How fast ``GET /health`` answers while a burst of generation requests runs.

Sends ``--burst`` chat requests at once (more than the replicas admit, so many
wait or get 429) and polls ``/health`` every ``--poll-ms`` from its own
process and connection until the burst has been answered; reports the probes'
latency percentiles and their statuses. ``--path /-/healthz`` probes Serve's
proxy's own answer instead: the floor any route behind the proxy can reach.

    python -m benchmarks.health_under_burst --url http://127.0.0.1:8000 --model glm-4-9b-chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import httpx

from benchmarks.records import percentiles


async def burst(url: str, model: str, count: int, tokens: int) -> dict[int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": tokens}
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body) for _ in range(count)), return_exceptions=True
        )
    statuses: dict[Any, int] = {}
    for response in responses:
        key = response.status_code if isinstance(response, httpx.Response) else type(response).__name__
        statuses[key] = statuses.get(key, 0) + 1
    return statuses


def probe(url: str, path: str, poll_s: float, stop: Connection) -> None:
    """In its own process (the burst's client loop must not delay it): GET ``path`` until told to stop."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get(path)  # connected: the burst may start
        stop.send("probing")
        while True:  # at least one probe, however short the burst
            started = time.perf_counter()
            response = client.get(path)
            latencies.append(time.perf_counter() - started)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if stop.poll():
                break
            time.sleep(poll_s)
    stop.send((latencies, statuses))


async def measure(url: str, model: str, count: int, tokens: int, poll_s: float, path: str) -> dict[str, Any]:
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    prober = multiprocessing.get_context("spawn").Process(target=probe, args=(url, path, poll_s, theirs))
    prober.start()
    await asyncio.to_thread(ours.recv)  # the prober is under way
    started = time.perf_counter()
    answers = await burst(url, model, count, tokens)
    ours.send("stop")
    latencies, statuses = await asyncio.to_thread(ours.recv)
    prober.join()
    return {
        "burst": {
            "requests": count,
            "max_tokens": tokens,
            "statuses": answers,
            "seconds": round(time.perf_counter() - started, 1),
        },
        "health": {
            "path": path,
            "probes": len(latencies),
            "statuses": statuses,
            "latency_ms": percentiles(latencies),
            "max_ms": max(latencies) * 1000 if latencies else None,
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="glm-4-9b-chat")
    parser.add_argument("--burst", type=int, default=600, help="requests sent at once")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each")
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument(
        "--path", default="/health", help="what to probe; /-/healthz is answered by Serve's proxy alone, a baseline"
    )
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.url, args.model, args.burst, args.tokens, args.poll_ms / 1000, args.path))
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main()
