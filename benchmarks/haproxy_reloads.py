"""HAProxy's old processes while long answers stream through replica changes: how many, how much memory.

Every change in the set of model replicas makes Serve reload HAProxy with a new process; the
old one keeps the connections it holds until they end (or until
``RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S``, 1020 s in deploy/cluster.env). So old processes pile up
while long answers stream and replicas change. This keeps ``--streams`` clients each streaming
``--max-tokens``-token answers one after another, scales the model deployment between 2 and 3
replicas (``--changes`` times, Serve's lightweight update: no replica is rebuilt), each change
``--every-s`` seconds after the last one's replicas run, then lets the last answers end.
Meanwhile it samples the HAProxy processes on this machine once a second (count, resident
memory), and reports their peak, the memory per process, and whether every answer ended
complete (``[DONE]``, every token).

    python -m benchmarks.haproxy_reloads --write-config /tmp/reloads.yaml
    make serve CONFIG=/tmp/reloads.yaml        # in another shell; then, once it answers:
    RAY_AUTH_MODE=token python -m benchmarks.haproxy_reloads --config /tmp/reloads.yaml

The written config is deploy/config.sim.yaml's with 2 model replicas (no autoscaling, so that
the benchmark sets their number), no model load time and a slower simulated step (20 ms more
per step, about 37 tokens a second per stream, a GPU's pace at load), so a 2,000-token answer
streams for about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from benchmarks.client import Workload, stream_once
from benchmarks.records import RequestRecord

SIM_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "config.sim.yaml"
DEPLOYMENT = "model-glm-4-9b-chat"
MODEL = "glm-4-9b-chat"


def write_config(path: Path) -> None:
    """deploy/config.sim.yaml's application with a fixed replica count, no load time, slower steps."""
    config = yaml.safe_load(SIM_CONFIG.read_text())
    (app,) = config["applications"]
    (model,) = app["args"]["models"]
    model["simulated_engine"] = {"load_s": 0, "step_launch_ms": 21.4}
    deployment = model["deployment"]
    deployment.pop("autoscaling_config")
    deployment["num_replicas"] = 2
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def with_replicas(config: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The config with Serve's own override of the model deployment's replica count (beside
    ``args``: a lightweight update, docs/operations.md)."""
    changed = yaml.safe_load(yaml.safe_dump(config))
    (app,) = changed["applications"]
    app["deployments"] = [{"name": DEPLOYMENT, "num_replicas": replicas}]
    return changed


@dataclass
class Samples:
    """HAProxy's processes, once a second: how many, their resident memory (MiB)."""

    counts: list[int] = field(default_factory=list)
    total_mib: list[float] = field(default_factory=list)
    per_process_mib: list[float] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)  # every HAProxy process seen: one more per reload

    def take(self) -> int:
        found = []
        for process in psutil.process_iter(["name", "memory_info"]):
            if process.info["name"] == "haproxy" and process.info["memory_info"] is not None:
                found.append(process.info["memory_info"].rss / 2**20)
                self.pids.add(process.pid)
        self.counts.append(len(found))
        self.total_mib.append(sum(found))
        self.per_process_mib.extend(found)
        return len(found)


async def sample(samples: Samples, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.take()
        await asyncio.sleep(1.0)


async def stream_loop(
    client: httpx.AsyncClient, workload: Workload, until: asyncio.Event, delay_s: float
) -> list[RequestRecord]:
    """Answers one after another from ``delay_s`` on, until ``until`` is set."""
    await asyncio.sleep(delay_s)
    records = []
    while not until.is_set():
        records.append(await stream_once(client, workload))
    return records


async def run(args: argparse.Namespace) -> None:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(args.config.read_text())
    serve = ServeSubmissionClient(args.dashboard)

    def deploy(replicas: int) -> None:
        body = ServeDeploySchema.model_validate(with_replicas(config, replicas)).model_dump(exclude_unset=True)
        serve.deploy_applications(body)

    def running() -> int:
        (app,) = serve.get_serve_details()["applications"].values()
        return sum(r["state"] == "RUNNING" for r in app["deployments"][DEPLOYMENT]["replicas"])

    async def change_to(replicas: int) -> None:
        """Deploy the change, then wait until exactly that many replicas run: a replica removed
        while it still starts changes nothing HAProxy sends to."""
        await asyncio.to_thread(deploy, replicas)
        deadline = time.monotonic() + args.change_within_s
        while await asyncio.to_thread(running) != replicas:
            if time.monotonic() > deadline:
                raise SystemExit(f"{replicas} replicas did not run within {args.change_within_s:g} s")
            await asyncio.sleep(1.0)

    workload = Workload(MODEL, input_tokens=64, output_tokens=args.max_tokens, endpoint="chat")
    samples, sampling_done, streams_done = Samples(), asyncio.Event(), asyncio.Event()
    sampler = asyncio.create_task(sample(samples, sampling_done))
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(None, connect=10)) as client:
        # Starts spread over --stagger-s, as a service's answers start: each change then finds
        # streams of every age, held by the HAProxy processes of the changes before.
        loops = [
            asyncio.create_task(stream_loop(client, workload, streams_done, i * args.stagger_s / args.streams))
            for i in range(args.streams)
        ]
        started = time.monotonic()
        for change in range(args.changes):
            await asyncio.sleep(args.every_s)
            await change_to(3 if change % 2 == 0 else 2)
        streams_done.set()  # no new answers; the ones under way run to their end
        records = [r for loop in await asyncio.gather(*loops) for r in loop]
    ended = time.monotonic() - started
    while samples.take() > 1 and time.monotonic() - started < ended + args.settle_s:
        await asyncio.sleep(1.0)  # the old processes go once their last connection has
    sampling_done.set()
    await sampler
    await asyncio.to_thread(deploy, 2)
    report(args, records, samples, ended)


def report(args: argparse.Namespace, records: list[RequestRecord], samples: Samples, ended_s: float) -> None:
    complete = [r for r in records if r.ok and r.output_tokens == args.max_tokens]
    cut = [r for r in records if not (r.ok and r.output_tokens == args.max_tokens)]
    lasted = sorted(r.e2e_s for r in complete if r.e2e_s is not None)
    streams = f"{args.streams} streams of {args.max_tokens} tokens"
    print(f"{args.changes} replica changes, each {args.every_s:g} s after the last one's replicas ran; {streams}")
    print(f"answers: {len(records)}, complete {len(complete)}, cut or refused {len(cut)}")
    for record in cut[:5]:
        print(f"  cut: {record.error} after {record.output_tokens} tokens")
    if lasted:
        print(f"an answer lasted {lasted[0]:.0f}-{lasted[-1]:.0f} s; the changes and the answers took {ended_s:.0f} s")
    seen, peak, last = len(samples.pids), max(samples.counts), samples.counts[-1]
    print(f"HAProxy processes: {seen} seen, at most {peak} at once, {last} at the end")
    print(f"their resident memory together: at most {max(samples.total_mib):.0f} MiB")
    print(f"one process: {min(samples.per_process_mib):.0f}-{max(samples.per_process_mib):.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-config", type=Path, help="write the benchmark's serve config here, and exit")
    parser.add_argument("--config", type=Path, help="the serve config `make serve` runs (from --write-config)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--dashboard", default="http://127.0.0.1:8265", help="Ray's dashboard (Serve's REST API)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--stagger-s", type=float, default=60.0, help="the streams' first answers start over this long")
    parser.add_argument("--changes", type=int, default=8, help="replica changes (2 -> 3 -> 2 ...)")
    parser.add_argument("--every-s", type=float, default=15.0, help="between a change's replicas running and the next")
    parser.add_argument("--change-within-s", type=float, default=180.0, help="longest wait for a change's replicas")
    parser.add_argument("--settle-s", type=float, default=120.0, help="longest wait for the old processes to go")
    args = parser.parse_args()
    if args.write_config:
        write_config(args.write_config)
        return
    if args.config is None:
        parser.error("--config is needed (write one with --write-config)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
