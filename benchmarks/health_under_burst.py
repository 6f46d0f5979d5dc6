"""How fast ``GET /health`` answers while a burst of generation requests runs.

Sends ``--burst`` chat requests at once (more than the replicas admit, so many
wait or get 429) and polls ``/health`` every ``--poll-ms`` from its own
connection until the burst has been answered; reports the probes' latency
percentiles and their statuses.

    python -m benchmarks.health_under_burst --url http://127.0.0.1:8000 --model glm-4-9b-chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
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


async def probe(url: str, poll_s: float, stop: asyncio.Event) -> tuple[list[float], dict[int, int]]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        while not stop.is_set():
            started = time.perf_counter()
            response = await client.get("/health")
            latencies.append(time.perf_counter() - started)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            await asyncio.sleep(poll_s)
    return latencies, statuses


async def measure(url: str, model: str, count: int, tokens: int, poll_s: float) -> dict[str, Any]:
    stop = asyncio.Event()
    prober = asyncio.create_task(probe(url, poll_s, stop))
    started = time.perf_counter()
    answers = await burst(url, model, count, tokens)
    stop.set()
    latencies, statuses = await prober
    return {
        "burst": {"requests": count, "max_tokens": tokens, "statuses": answers,
                  "seconds": round(time.perf_counter() - started, 1)},
        "health": {"probes": len(latencies), "statuses": statuses, "latency_ms": percentiles(latencies),
                   "max_ms": max(latencies) * 1000 if latencies else None},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="glm-4-9b-chat")
    parser.add_argument("--burst", type=int, default=600, help="requests sent at once")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each")
    parser.add_argument("--poll-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.url, args.model, args.burst, args.tokens, args.poll_ms / 1000))
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main()
