"""How fast a burst past the queue is refused while long streams hold every engine slot.

    python -m benchmarks.burst_admission --config deploy/config.sim.yaml --hold-tokens 4000 --burst 800
    python -m benchmarks.burst_admission --haproxy ...   # Serve's HAProxy and throughput mode

Starts this app with one model replica (``benchmarks.servers.this_app``),
opens one long stream per engine slot and waits until each has its first token, then sends
``--burst`` short requests at once. Reports how many were refused (429) and when, from the
burst's start, and when the last answer came. With ``--haproxy`` Ray starts with
``RAY_SERVE_ENABLE_HA_PROXY`` and ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` (request logs unbuffered),
the settings docs/performance.md compares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import servers

REPO = Path(__file__).resolve().parents[1]
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}
START_S = 120  # for every held stream's first token


@dataclass(frozen=True)
class Outcome:
    status: int | str  # HTTP status, or the client's exception name
    at_s: float  # answered, seconds after the burst began


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Refused and completed counts, the first and last refusal and the last answer (seconds)."""
    refused = sorted(o.at_s for o in outcomes if o.status == 429)
    answered = [o.at_s for o in outcomes if o.status == 200]
    return {
        "refused": len(refused),
        "completed": len(answered),
        "other": sorted({str(o.status) for o in outcomes} - {"200", "429"}),
        "first_refusal_s": round(refused[0], 2) if refused else None,
        "last_refusal_s": round(refused[-1], 2) if refused else None,
        "all_done_s": round(max(o.at_s for o in outcomes), 2) if outcomes else None,
    }


def chat(model: str, tokens: int, stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi."}]
    return {"model": model, "messages": messages, "max_tokens": tokens, "min_tokens": tokens, "stream": stream}


async def measure(url: str, model: str, slots: int, hold_tokens: int, burst: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=slots + burst, max_keepalive_connections=slots + burst)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started: asyncio.Queue[None] = asyncio.Queue()

        async def hold() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=chat(model, hold_tokens, True)) as response:
                first = True
                async for line in response.aiter_lines():
                    if first and line.startswith("data:"):
                        first = False
                        started.put_nowait(None)

        holders = [asyncio.create_task(hold()) for _ in range(slots)]
        for _ in range(slots):
            await asyncio.wait_for(started.get(), START_S)
        begin = time.monotonic()

        async def one() -> Outcome:
            try:
                status: int | str = (await client.post("/v1/chat/completions", json=chat(model, 24))).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            return Outcome(status, time.monotonic() - begin)

        outcomes = await asyncio.gather(*(one() for _ in range(burst)))
        held_ended = sum(task.done() for task in holders)
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    return summarize(outcomes) | {"held_streams_ended_meanwhile": held_ended}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.burst_admission", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.cpu.yaml")
    parser.add_argument("--hold-tokens", type=int, default=900, help="each held stream's answer")
    parser.add_argument("--burst", type=int, default=480)
    parser.add_argument("--haproxy", action="store_true", help="Serve's HAProxy and throughput mode")
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    model = config["applications"][0]["args"]["models"][0]
    slots = model["engine_args"]["max_num_seqs"]
    with tempfile.TemporaryDirectory(prefix="burst-admission-") as workdir:
        server = servers.this_app(config, None, Path(workdir), REPO)
        server = replace(server, env=server.env | (HAPROXY_ENV if args.haproxy else {}))
        with servers.running(server, Path(workdir) / "serve.log"):
            result = asyncio.run(measure(server.url, model["name"], slots, args.hold_tokens, args.burst))
    result = {"config": str(args.config), "haproxy": args.haproxy, "burst": args.burst} | result
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
