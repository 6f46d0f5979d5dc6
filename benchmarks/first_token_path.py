"""Where the first token spends its time on the direct path: HAProxy and the picker, or the replica.

    python -m benchmarks.first_token_path --config deploy/config.sim.yaml [--endpoint chat] [--concurrency 64]

Starts this app as ``benchmarks.serving_overhead`` does (one model replica, simulated
engine, Serve's cluster settings), then, one request at a time (or ``--concurrency`` streams
at once on the first two paths), in rounds that alternate:

1. time to first token through Serve's HAProxy (HTTP port): HAProxy asks the ReplicaPicker
   where to send the request, then forwards it to the model replica's own HTTP server;
2. time to first token at the model replica's own HTTP server, skipping HAProxy and the picker;
3. the picker's answer alone, asked as HAProxy's Lua action asks it (a new connection, HTTP/1.0,
   the request's body), with and without the body.

(1) minus (2) is what the route through HAProxy adds to the first token. The replica's and
the picker's ports are read from the files Serve's HAProxy manager writes for the running
cluster (``haproxy.cfg`` and ``ingress_request_router.lua`` beside it), so this needs
``ingress.direct_streaming`` and HAProxy (deploy/cluster.env) on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks.client import Workload
from benchmarks.load import Clients, Load, run_load
from benchmarks.servers import app_entry, running, this_app

REPO = Path(__file__).resolve().parents[1]
# Where Serve's HAProxy manager writes its files, one directory per cluster (Ray 2.60,
# ray.serve._private.constants.RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's directory).
HAPROXY_DIR = Path("/tmp/haproxy-serve")


def newest_haproxy_files(started_at: float) -> tuple[str, str]:
    """The running cluster's ``haproxy.cfg`` and Lua router script, written since ``started_at``."""
    configs = [p for p in HAPROXY_DIR.glob("*/haproxy.cfg") if p.stat().st_mtime >= started_at]
    if not configs:
        raise SystemExit(f"no haproxy.cfg under {HAPROXY_DIR} written by this run: is HAProxy on?")
    config = max(configs, key=lambda p: p.stat().st_mtime)
    lua = config.with_name("ingress_request_router.lua")
    if not lua.exists():
        raise SystemExit(f"{lua} is missing: is ingress.direct_streaming on?")
    return config.read_text(), lua.read_text()


def replica_port(haproxy_config: str) -> int:
    """The model replica's own HTTP port: the Serve replica server of HAProxy's HTTP backends."""
    ports: set[int] = set()
    backend = ""
    for line in haproxy_config.splitlines():
        if not line.startswith(" "):
            backend = line
        server = re.match(r"\s+server SERVE_REPLICA\S* [\d.]+:(\d+) ", line)
        if server and backend.startswith("backend http-"):
            ports.add(int(server.group(1)))
    if len(ports) != 1:
        raise SystemExit(f"expected one model replica's HTTP port in haproxy.cfg, found {sorted(ports)}")
    return ports.pop()


def picker_port(lua_script: str) -> int:
    """The ReplicaPicker's port, from the ``ROUTERS`` table of HAProxy's Lua action."""
    table = re.search(r"^local ROUTERS = \{(.*?)^\}", lua_script, re.M | re.S)
    ports = re.findall(r"port\s*=\s*(\d+)", table.group(1)) if table else []
    if not ports:
        raise SystemExit("no router port in the Lua script's ROUTERS table")
    return int(ports[0])


async def first_tokens_ms(url: str, workload: Workload, requests: int, concurrency: int = 1) -> list[float]:
    clients = Clients(url, {})
    try:
        records = await run_load(clients, workload, Load(requests=requests, concurrency=concurrency))
    finally:
        await clients.aclose()
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise SystemExit(f"{url}: {len(failed)} requests failed, first: {failed[0]}")
    return [1000 * r.ttft_s for r in records if r.ttft_s is not None]


async def picker_answers_ms(port: int, body: dict[str, Any] | None, requests: int) -> list[float]:
    """The picker's round trip as HAProxy's Lua action makes it: a connection per request, closed after."""
    payload = json.dumps(body).encode() if body is not None else b""
    head = (
        "POST /internal/route HTTP/1.0\r\nHost: picker\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + payload)
        answer = await reader.read()
        writer.close()
        times.append(1000 * (time.perf_counter() - started))
        if not answer.startswith(b"HTTP/1.1 200") or b"replica_id" not in answer:
            raise SystemExit(f"the picker answered: {answer[:200]!r}")
    return times


async def measure(
    url: str, started_at: float, workload: Workload, rounds: int, requests: int, concurrency: int = 1
) -> dict[str, Any]:
    haproxy_config, lua_script = newest_haproxy_files(started_at)
    replica = f"http://127.0.0.1:{replica_port(haproxy_config)}"
    picker = picker_port(lua_script)
    await first_tokens_ms(url, workload, 4)  # warm up
    paths: dict[str, Callable[[], Awaitable[list[float]]]] = {
        "first token through HAProxy": lambda: first_tokens_ms(url, workload, requests, concurrency),
        "first token at the replica's own port": lambda: first_tokens_ms(replica, workload, requests, concurrency),
        "picker's answer, with the body": lambda: picker_answers_ms(picker, workload.body(), requests),
        "picker's answer, no body": lambda: picker_answers_ms(picker, None, requests),
    }
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, run in paths.items():
            samples[name] += await run()
    return {name: {"p50_ms": statistics.median(values), "samples": len(values)} for name, values in samples.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_token_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.sim.yaml")
    parser.add_argument("--endpoint", choices=["completions", "chat", "responses"], default="completions")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1, help="streams at once on the first-token paths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40, help="per path and round")
    parser.add_argument("--app-env", nargs="+", default=[], metavar="NAME=VALUE")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    _, entry = app_entry(config, None)
    workload = Workload(entry["name"], 32, args.output_tokens, args.endpoint)
    with tempfile.TemporaryDirectory() as workdir:
        server = this_app(config, None, Path(workdir), REPO)
        server = replace(server, env=server.env | dict(item.split("=", 1) for item in args.app_env))
        started_at = time.time()
        with running(server, Path(workdir) / "app.log"):
            result = asyncio.run(
                measure(server.url, started_at, workload, args.rounds, args.requests, args.concurrency)
            )
    for name, figures in result.items():
        print(f"{name:40} p50 {figures['p50_ms']:6.2f} ms  ({figures['samples']} samples)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
