"""Does parsing hostile request bodies stall the streams an ingress replica is relaying?

Streams one answer token by token, first alone ("quiet"), then while another
client posts large hostile bodies at a fixed rate (default: 8 MB, 10 per second),
and reports the stream's inter-token gaps in both runs. The bodies are the
expensive kinds for a JSON front end: millions of brackets (refused by the
structure check), a request with megabytes of messages and one bad parameter
(parsed and validated in full, off the event loop, then refused), and a valid
request whose one prompt is megabytes long (refused by its size before any
tokenizer runs), so all of the cost is the front door's and none reaches an engine.
``--kinds "one prompt too long for the context"`` sends that kind alone.

    python -m benchmarks.hostile_bodies --url http://127.0.0.1:8000 --model glm-4-9b-chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import httpx

from benchmarks.client import Workload, stream_once
from benchmarks.records import RequestRecord, percentiles


def hostile_bodies(model: str, size_bytes: int) -> dict[str, bytes]:
    """Bodies of about ``size_bytes`` each, by what makes them costly."""
    head = b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "metadata": '
    pairs = max(1, (size_bytes - len(head)) // 3)
    message = {"role": "user", "content": "x" * 100}
    legit = {"model": model, "temperature": 5, "messages": [message] * max(1, size_bytes // 140)}
    long_prompt = {"model": model, "messages": [{"role": "user", "content": "x" * max(1, size_bytes - 100)}]}
    return {
        "brackets": head + b"[" + b"[]," * pairs + b"[]]}",
        "deep": b"[" * (size_bytes // 2) + b"]" * (size_bytes // 2),
        "many messages, one bad parameter": json.dumps(legit).encode(),
        "one prompt too long for the context": json.dumps(long_prompt).encode(),
    }


async def post_hostile(url: str, bodies: list[bytes], per_second: float, stop: asyncio.Event) -> dict[Any, int]:
    """Post ``bodies`` in turn at ``per_second`` until ``stop``; count answers by status."""
    statuses: dict[Any, int] = {}  # HTTP status, or the client's error
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:

        async def one(body: bytes) -> None:
            try:
                response = await client.post(
                    "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
                )
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            except httpx.HTTPError as exc:
                name = type(exc).__name__
                statuses[name] = statuses.get(name, 0) + 1

        tasks = []
        sent = 0
        started = time.perf_counter()
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(bodies[sent % len(bodies)])))
            sent += 1
            await asyncio.sleep(max(0.0, started + sent / per_second - time.perf_counter()))
        await asyncio.gather(*tasks)
    return statuses


async def measure(
    url: str, model: str, tokens: int, size_bytes: int, per_second: float, kinds: list[str] | None = None
) -> dict[str, Any]:
    # A completion from token ids: every token is its own chunk (a chat delta with no text is not sent).
    workload = Workload(model=model, input_tokens=16, output_tokens=tokens)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await stream_once(client, Workload(model=model, input_tokens=16, output_tokens=8))  # warm
        quiet = await stream_once(client, workload)
        stop = asyncio.Event()
        bodies = [body for kind, body in hostile_bodies(model, size_bytes).items() if not kinds or kind in kinds]
        sender = asyncio.create_task(post_hostile(url, bodies, per_second, stop))
        await asyncio.sleep(1.0)  # the hostile load is under way before the stream starts
        loaded = await stream_once(client, workload)
        stop.set()
        statuses = await sender
    return {
        "tokens": tokens,
        "hostile": {"bytes": size_bytes, "per_second": per_second, "kinds": kinds or "all", "statuses": statuses},
        "quiet": summary(quiet),
        "under hostile bodies": summary(loaded),
    }


def summary(record: RequestRecord) -> dict[str, Any]:
    gaps = percentiles(record.gaps_s)
    return {
        "ok": record.ok,
        "error": record.error,
        "gaps_ms": gaps,
        "max_gap_ms": max(record.gaps_s) * 1000 if record.gaps_s else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="glm-4-9b-chat")
    parser.add_argument("--tokens", type=int, default=400, help="the measured stream's length")
    parser.add_argument("--body-bytes", type=int, default=8 * 1024 * 1024 - 4096)
    parser.add_argument("--per-second", type=float, default=10.0, help="hostile bodies sent per second")
    parser.add_argument("--kinds", nargs="+", metavar="KIND", help="only these kinds of body (default: every kind)")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.url, args.model, args.tokens, args.body_bytes, args.per_second, args.kinds))
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main()
