"""Redis's memory per byte the response store counts against its keys (docs/operations.md sizes
Redis from ``max_bytes_per_key`` with it).

Writes background answers as the store writes them (a queued object and input items, ``--events``
delta events of vLLM's shape, the final object with the whole text) into a Redis of its own
(Debian's ``redis-server``, as shipped: ``noeviction``), spread over ten keys, and reports the bytes
the keys were charged, Redis's ``used_memory`` growth and their ratio, for each shape asked for::

    python -m benchmarks.store_memory --shapes 200x500 2000x20 100x2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis

from serve_app.front_door.answer_log.redis_store import PREFIX, RedisStore
from tools.local_redis import LocalRedis

KEYS = 10


def delta(number: int) -> str:
    data = {
        "content_index": 0,
        "delta": " word",
        "item_id": "msg_" + "a" * 32,
        "logprobs": [],
        "output_index": 0,
        "sequence_number": number,
        "type": "response.output_text.delta",
    }
    return f"event: response.output_text.delta\ndata: {json.dumps(data)}\n\n"


async def measure(answers: int, events: int) -> str:
    server = LocalRedis(Path(tempfile.mkdtemp(prefix="store-memory-"))).start()
    client: Any = aioredis.Redis(port=server.port, password=server.password)  # (redis-py's types: Any)
    store = RedisStore(client, 3600, answers, max_bytes_per_key=1 << 40)
    try:
        before = (await client.info("memory"))["used_memory"]
        for number in range(answers):
            rid = f"resp_{number:032x}"
            queued = {"id": rid, "object": "response", "status": "queued", "output": [], "model": "glm-4-9b-chat"}
            items = [{"type": "message", "role": "user", "content": "hello " * 40}]
            await store.save(rid, f"key-{number % KEYS}", queued, items, background=True)
            for event in range(events):
                await store.append(rid, event, delta(event))
            text = {"type": "output_text", "text": " word" * events}
            await store.update(
                rid, queued | {"status": "completed", "output": [{"type": "message", "content": [text]}]}
            )
        grew = (await client.info("memory"))["used_memory"] - before
        charged = 0
        for key in range(KEYS):
            charged += int(await client.hget(f"{PREFIX}owner:key-{key}:bytes", "*") or 0)
        return (
            f"{answers} answers x {events} events: charged {charged / 1e6:.1f} MB, "
            f"Redis grew {grew / 1e6:.1f} MB, {grew / charged:.2f}x"
        )
    finally:
        await client.aclose()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["200x500", "2000x20", "100x2000"], help="ANSWERSxEVENTS")
    for shape in parser.parse_args().shapes:
        answers, events = (int(part) for part in shape.split("x"))
        print(asyncio.run(measure(answers, events)))


if __name__ == "__main__":
    main()
