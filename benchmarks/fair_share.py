"""One key floods, another sends one request at a time: the light key's first tokens, flood or not.

    python -m benchmarks.fair_share --config deploy/config.sim.yaml
    python -m benchmarks.fair_share --config deploy/config.sim.yaml --no-fair-share

Starts this app with one model replica (``benchmarks.servers.this_app``) and two API keys. Key
B first sends ``--light-requests`` streams one after another alone; then key A keeps
``--flood`` streams of ``--flood-tokens`` open (more than the replica runs and queues: each
refused one is sent again after its ``Retry-After``), and once A's first refusal came, or
``--settle-s`` passed, key B sends the same requests again. Reports B's time to first token
(p50, p99) alone and under the flood, A's TTFT p99 and what A's requests got (status counts).
``--no-fair-share`` sets ``ingress.fair_share: false``.

Key B's client runs in a process of its own, with httpx. The flood's streams are plain HTTP/1.1
on sockets, their bodies read in blocks and not parsed (:func:`raw_stream`): with httpx the
flood's client kept a core busy, and its backlog drained within about 20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import servers

REPO = Path(__file__).resolve().parents[1]
FLOOD_KEY, LIGHT_KEY = "sk-bench-flood-5e1b7c-0123456789", "sk-bench-light-90a4d2-0123456789"


@dataclass(frozen=True)
class Answer:
    status: int | str  # HTTP status, or the client's exception name
    ttft_s: float | None  # first content event after sending (None: none came)
    retry_after_s: float = 0.0


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank) in milliseconds, or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))], 1)


def with_keys(config_path: Path, keys_file: Path, fair_share: bool) -> None:
    """Give the config ``servers.this_app`` wrote the two keys, and the chosen fair share."""
    config = yaml.safe_load(config_path.read_text())
    ingress = config["applications"][0]["args"]["ingress"]
    ingress |= {"api_keys": {"file": str(keys_file)}, "fair_share": fair_share}
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))


async def stream(client: httpx.AsyncClient, key: str, model: str, tokens: int) -> Answer:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi."}],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": True,
    }
    sent = time.monotonic()
    try:
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            ttft = None
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"error"' not in line:
                    ttft = time.monotonic() - sent
            retry = float(response.headers.get("retry-after", 0) or 0)
            return Answer(response.status_code, ttft, retry)
    except httpx.HTTPError as exc:
        return Answer(type(exc).__name__, None)


async def raw_stream(host: str, port: int, key: str, model: str, tokens: int) -> Answer:
    """A stream as the flood sends it: a connection of its own, the request written whole, the
    answer read in blocks until the server closes it; its first token is the first block holding
    an event that is not an error."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": tokens,
            "min_tokens": tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sent = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return Answer(type(exc).__name__, None)
    try:
        writer.write(head + body)
        header = await reader.readuntil(b"\r\n\r\n")
        status = int(header.split(b" ", 2)[1])
        retry = next(
            (
                float(line.split(b":", 1)[1])
                for line in header.split(b"\r\n")
                if line.lower().startswith(b"retry-after:")
            ),
            0.0,
        )
        ttft = None
        while block := await reader.read(1 << 16):
            if ttft is None and b"data: {" in block and b'"error"' not in block:
                ttft = time.monotonic() - sent
        return Answer(status, ttft, retry)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return Answer(type(exc).__name__, None)
    finally:
        writer.close()


async def light_requests(url: str, model: str, count: int, tokens: int) -> list[Answer]:
    async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as client:
        return [await stream(client, LIGHT_KEY, model, tokens) for _ in range(count)]


def light_in_own_process(url: str, model: str, count: int, tokens: int) -> list[Answer]:
    """Key B's requests, one at a time (run in a process of its own)."""
    return asyncio.run(light_requests(url, model, count, tokens))


def light_summary(answers: list[Answer]) -> dict[str, Any]:
    ttfts = [a.ttft_s for a in answers if a.ttft_s is not None]
    statuses = Counter(str(a.status) for a in answers)
    return {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99), "statuses": dict(statuses)}


async def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    light_client = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    light = (url, model, args.light_requests, args.light_tokens)
    address = httpx.URL(url)
    host, port = address.host, address.port or 80
    alone = await loop.run_in_executor(light_client, light_in_own_process, *light)
    stop, refused = asyncio.Event(), asyncio.Event()
    flood: list[Answer] = []

    async def flooding() -> None:
        while not stop.is_set():
            answer = await raw_stream(host, port, FLOOD_KEY, model, args.flood_tokens)
            flood.append(answer)
            if answer.status == 429:
                refused.set()
                await asyncio.sleep(answer.retry_after_s or 1.0)

    workers = [asyncio.create_task(flooding()) for _ in range(args.flood)]
    try:
        await asyncio.wait_for(refused.wait(), args.settle_s)
    except TimeoutError:
        pass
    flooded = await loop.run_in_executor(light_client, light_in_own_process, *light)
    stop.set()
    await asyncio.gather(*workers)
    light_client.shutdown()
    flood_ttfts = [a.ttft_s for a in flood if a.ttft_s is not None]
    return {
        "light_alone": light_summary(alone),
        "light_under_flood": light_summary(flooded),
        "flood_ttft_p99_ms": percentile(flood_ttfts, 99),
        "flood_statuses": dict(Counter(str(a.status) for a in flood)),
        "flood_refused_before_light": refused.is_set(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fair_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.sim.yaml")
    parser.add_argument("--flood", type=int, default=640, help="streams key A keeps open")
    parser.add_argument("--flood-tokens", type=int, default=256)
    parser.add_argument("--light-requests", type=int, default=20, help="key B's requests, one at a time")
    parser.add_argument("--light-tokens", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=60.0, help="longest wait for the flood's first 429")
    parser.add_argument("--no-fair-share", dest="fair_share", action="store_false")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    model = config["applications"][0]["args"]["models"][0]["name"]
    with tempfile.TemporaryDirectory(prefix="fair-share-") as workdir:
        keys_file = Path(workdir) / "api-keys"
        keys_file.write_text(f"{FLOOD_KEY}\n{LIGHT_KEY}\n")
        server = servers.this_app(config, None, Path(workdir), REPO)
        with_keys(Path(workdir) / "serve_config.yaml", keys_file, args.fair_share)
        with servers.running(server, Path(workdir) / "serve.log"):
            result = asyncio.run(measure(server.url, model, args))
    result = {
        "config": str(args.config),
        "fair_share": args.fair_share,
        "flood": args.flood,
    } | result
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
