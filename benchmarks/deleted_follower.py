"""How soon a follower of a background answer ends once the answer is deleted, and ``/health`` meanwhile.

Posts a background Responses answer (``--tokens`` tokens, ``ignore_eos``), follows it with ``GET
/v1/responses/{id}?stream=true``, DELETEs it ``--delete-after-s`` in, and probes ``/health`` every
20 ms from a connection of its own until a second after the follower ended; reports, for each of
``--runs`` answers, how long after the DELETE the follower's stream ended, its last event, and the
slowest probe. Run it against ``make serve`` (the CPU config: one replica, the in-process store).

    python -m benchmarks.deleted_follower --url http://127.0.0.1:8000 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import httpx

PROBE_EVERY_S = 0.02


async def probe(client: httpx.AsyncClient, until: asyncio.Event) -> list[float]:
    """``/health``'s latency, probe by probe, until ``until`` is set."""
    latencies = []
    while not until.is_set():
        started = time.perf_counter()
        await client.get("/health")
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(PROBE_EVERY_S)
    return latencies


async def follow(client: httpx.AsyncClient, response_id: str) -> tuple[list[dict[str, Any]], float]:
    """The answer's events as its follower read them, and when its stream ended."""
    events = []
    async with client.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true"}) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events, time.perf_counter()


async def one_run(url: str, model: str, tokens: int, delete_after_s: float) -> dict[str, Any]:
    clients = httpx.AsyncClient(base_url=url, timeout=60), httpx.AsyncClient(base_url=url, timeout=60)
    async with clients[0] as client, clients[1] as prober:
        body = {"model": model, "input": "Go on.", "background": True, "max_output_tokens": tokens, "ignore_eos": True}
        posted = await client.post("/v1/responses", json=body)
        posted.raise_for_status()
        response_id = posted.json()["id"]
        stop = asyncio.Event()
        probes = asyncio.create_task(probe(prober, stop))
        follower = asyncio.create_task(follow(client, response_id))
        await asyncio.sleep(delete_after_s)
        deleted_at = time.perf_counter()
        deleted = await client.delete(f"/v1/responses/{response_id}")
        events, ended_at = await follower
        await asyncio.sleep(1.0)
        stop.set()
        latencies = await probes
    last = events[-1] if events else {}
    return {
        "delete_status": deleted.status_code,
        "follower_ended_after_delete_s": round(ended_at - deleted_at, 3),
        "events": len(events),
        "last_event": last.get("type"),
        "last_error_code": (last.get("error") or {}).get("code") if last.get("type") == "error" else None,
        "health_probes": len(latencies),
        "health_max_ms": round(max(latencies) * 1000, 1) if latencies else None,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="glm-4-9b-chat")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=900, help="the answer's max_output_tokens")
    parser.add_argument("--delete-after-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    runs = [asyncio.run(one_run(args.url, args.model, args.tokens, args.delete_after_s)) for _ in range(args.runs)]
    json.dump(runs, sys.stdout, indent=2)
    print()
    return runs


if __name__ == "__main__":
    main()
