"""Drive an OpenAI-compatible endpoint at fixed concurrencies or Poisson rates; write JSON and a plot.

    python -m benchmarks.load --url http://127.0.0.1:8000 --model glm-4-9b-chat \\
        --concurrency 1 16 64 --input-tokens 32 --output-tokens 64 --out bench.json --plot bench.png

``--protocol grpc`` sends the same load to this app's gRPC API (``--grpc-target``) instead, one
call per request; ``--protocol grpc-stream`` multiplexes the requests in flight on one Stream call
per client (``--stream-clients``, default 1).

Every request streams a fixed number of output tokens (``ignore_eos``) from a
prompt of fixed length, so runs compare like with like. Per request it records
time to first token, the gaps between chunks, time per output token and the
end-to-end latency; per load level, their percentiles and the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from benchmarks.client import Workload, stream_once
from benchmarks.records import RequestRecord, record_dict, summarize


@dataclass(frozen=True)
class Load:
    """Either ``concurrency`` clients sending back to back, or Poisson arrivals at ``rate`` per second."""

    requests: int
    concurrency: int | None = None
    rate: float | None = None

    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"rate {self.rate:g}/s"

    def as_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "rate": self.rate, "requests": self.requests}


class Progress:
    """One status line per load level on stderr, rewritten as requests finish."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.started = time.perf_counter()

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        elapsed = time.perf_counter() - self.started
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} done, {self.failed} failed, {elapsed:.1f} s ")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def timed(clients: ClientPool, client: Any, workload: Workload) -> RequestRecord:
    record = await clients.stream_once(client, workload)
    if record.ok and record.output_tokens != workload.output_tokens:
        record.ok = False
        record.error = f"{record.output_tokens} output tokens, asked for {workload.output_tokens}"
    return record


class Clients:
    """Idle one-connection clients, one per request in flight, kept open between requests.

    One httpx pool shared by dozens of busy streams spends the benchmark's own CPU scanning
    itself on every request (seen with py-spy), which would measure the client, not the server.
    A new client is made cheap: by default httpx loads the CA bundle and reads the proxy
    environment for each one (43 ms here), and a level's first wave makes its clients one
    after the other in the event loop that times its streams, so each stream's first token
    waited for the clients made after it (up to 2 s at 64 streams, on every side alike).
    """

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = url, headers
        self.ssl_context = ssl.create_default_context()  # one for all clients
        self.idle: list[httpx.AsyncClient] = []
        self.all: list[httpx.AsyncClient] = []

    def acquire(self) -> httpx.AsyncClient:
        if self.idle:
            return self.idle.pop()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=None)
        client = httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=600,
            limits=limits,
            verify=self.ssl_context,
            trust_env=False,  # local servers: no proxy from the environment
        )
        self.all.append(client)
        return client

    def release(self, client: httpx.AsyncClient) -> None:
        self.idle.append(client)

    async def stream_once(self, client: httpx.AsyncClient, workload: Workload) -> RequestRecord:
        return await stream_once(client, workload)

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.all))


class ClientPool(Protocol):
    """Idle clients of one protocol: :class:`Clients` (HTTP) or :class:`benchmarks.grpc_client.GRPCClients`."""

    def acquire(self) -> Any: ...

    def release(self, client: Any) -> None: ...

    async def stream_once(self, client: Any, workload: Workload) -> RequestRecord: ...

    async def aclose(self) -> None: ...


def client_pool(
    protocol: str,
    url: str,
    grpc_target: str,
    api_key: str | None,
    grpc_application: str | None = None,
    stream_clients: int = 1,
) -> ClientPool:
    if protocol == "grpc-stream":
        from benchmarks.grpc_client import MultiplexedClients

        return MultiplexedClients(grpc_target, api_key, grpc_application, stream_clients)
    if protocol == "grpc":
        from benchmarks.grpc_client import GRPCClients

        return GRPCClients(grpc_target, api_key, grpc_application)
    return Clients(url, {"Authorization": f"Bearer {api_key}"} if api_key else {})


async def run_load(clients: ClientPool, workload: Workload, load: Load, seed: int = 0) -> list[RequestRecord]:
    progress = Progress(load.label(), load.requests)
    records: list[RequestRecord] = []

    async def one() -> None:
        client = clients.acquire()
        try:
            record = await timed(clients, client, workload)
        finally:
            clients.release(client)
        records.append(record)
        progress.update(record)

    if load.concurrency:
        remaining = iter(range(load.requests))

        async def worker() -> None:
            for _ in remaining:
                await one()

        await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    else:
        arrivals = random.Random(seed)
        assert load.rate is not None  # a load is by concurrency or by rate
        tasks = []
        for _ in range(load.requests):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(arrivals.expovariate(load.rate))
        await asyncio.gather(*tasks)
    return records


async def run(
    url: str,
    workload: Workload,
    loads: list[Load],
    api_key: str | None,
    warmup: int,
    protocol: str = "http",
    grpc_target: str = "127.0.0.1:9000",
    grpc_application: str | None = None,
    stream_clients: int = 1,
) -> dict[str, Any]:
    clients = client_pool(protocol, url, grpc_target, api_key, grpc_application, stream_clients)
    try:
        if warmup:
            await run_load(clients, workload, Load(requests=warmup, concurrency=1))
        levels = []
        for load in loads:
            started = time.perf_counter()
            records = await run_load(clients, workload, load)
            summary = summarize(load.as_dict(), records, time.perf_counter() - started)
            levels.append(summary | {"records": [record_dict(r) for r in records]})
    finally:
        await clients.aclose()
    return {"url": url, "protocol": protocol, "workload": workload.__dict__, "levels": levels}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'load':>18} {'ok':>5} {'ttft p50':>9} {'tpot p50':>9} {'e2e p50':>9} {'e2e p99':>9} {'tok/s':>8}")
    for level in result["levels"]:
        load = level["load"]
        name = f"concurrency {load['concurrency']}" if load["concurrency"] else f"rate {load['rate']:g}/s"
        ok = level["requests"] - level["failed"]

        def ms(metric: str, p: str = "p50", level: dict[str, Any] = level) -> str:
            value = level[metric][p]
            return "-" if value is None else f"{value:.1f}"

        print(
            f"{name:>18} {ok:>5} {ms('ttft_ms'):>9} {ms('tpot_ms'):>9} {ms('e2e_ms'):>9} "
            f"{ms('e2e_ms', 'p99'):>9} {level['output_tokens_per_s']:>8.1f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server (no /v1)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", help="sent as a Bearer token")
    parser.add_argument(
        "--protocol",
        choices=["http", "grpc", "grpc-stream"],
        default="http",
        help="HTTP/SSE at --url, or the gRPC API at --grpc-target: a call per request, or the requests"
        " in flight multiplexed on --stream-clients Stream calls",
    )
    parser.add_argument("--stream-clients", type=int, default=1, help="grpc-stream: Stream calls the load shares")
    parser.add_argument("--grpc-target", default="127.0.0.1:9000", help="host:port of the gRPC API")
    parser.add_argument(
        "--grpc-application",
        help="the Serve application to call (gRPC metadata 'application'); needed where the cluster runs several",
    )
    parser.add_argument("--endpoint", choices=["completions", "chat", "responses"], default="completions")
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    loads = parser.add_mutually_exclusive_group(required=True)
    loads.add_argument("--concurrency", type=int, nargs="+", help="one level per value")
    loads.add_argument("--rate", type=float, nargs="+", help="Poisson arrivals per second, one level per value")
    parser.add_argument("--requests", type=int, help="per level (default: 4 x concurrency, at least 16; 64 per rate)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent one by one before measuring")
    parser.add_argument("--out", type=Path, help="write every figure and per-request record as JSON")
    parser.add_argument("--plot", type=Path, help="write latency percentiles and throughput against load as PNG")
    return parser.parse_args(argv)


def levels_from(args: argparse.Namespace) -> list[Load]:
    if args.concurrency:
        return [Load(requests=args.requests or max(16, 4 * c), concurrency=c) for c in args.concurrency]
    return [Load(requests=args.requests or 64, rate=r) for r in args.rate]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    workload = Workload(args.model, args.input_tokens, args.output_tokens, args.endpoint)
    loads = levels_from(args)
    result = asyncio.run(
        run(
            args.url,
            workload,
            loads,
            args.api_key,
            args.warmup,
            args.protocol,
            args.grpc_target,
            args.grpc_application,
            args.stream_clients,
        )
    )
    print_table(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        from benchmarks.plot import plot_levels

        plot_levels(result, args.plot)
    return result


if __name__ == "__main__":
    main()
