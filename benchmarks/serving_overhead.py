"""The serving layer's cost: vLLM's own front end against this app, both on the simulated engine.

    python -m benchmarks.serving_overhead --config deploy/config.sim.yaml --out-dir bench/overhead

On a machine without a GPU the simulated engine generates at an H100's pace for little CPU,
so what differs between the two sides is the serving layer. One at a time, alone:

1. vLLM's OpenAI API server, built as vLLM builds it (its FastAPI app and ``init_app_state``
   under uvicorn, one process) on the simulated engine (``benchmarks.vllm_frontend``);
2. this app (``serve run``) with one model replica, no API keys.

Each at 1, 16, 64 and 256 concurrent streams (32 prompt tokens, 256 output tokens): time to
first token p50/p99, time per output token p50, gaps between chunks p50/p99, end-to-end
p50, delivered tokens/s against what the timing model allows, and CPU seconds per 1,000
delivered tokens of every process of the side (read from the OS: Serve proxy, replica picker,
model replica, controller, Ray's daemons; vLLM's one process), plus the load client's own.
Prints a table and the goals of issue 22, writes JSON and a PNG.

``--app-only --app-protocols http grpc --endpoint chat`` measures this app alone over HTTP and
then over its gRPC API, on the same load and the same running app (app.json, app-grpc.json);
``--app-only --app-endpoints chat responses`` measures chat and then the Responses API over HTTP
(app-chat.json, app-responses.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.client import Workload
from benchmarks.load import ClientPool, Load, client_pool, run_load
from benchmarks.ray_serve_llm import ray_serve_llm_direct
from benchmarks.records import record_dict, summarize
from benchmarks.servers import ServerCommand, app_entry, running, simulated_vllm, this_app
from serve_app.config import SimulatedEngineConfig, sized_for

REPO = Path(__file__).resolve().parents[1]
# Requests per level, at least: one stream's first-token p50 is held to goals of a few ms,
# which 16 samples could not resolve on this shared machine.
MIN_REQUESTS = 64
VLLM, APP = "vllm", "app"


def process_role(process: psutil.Process) -> str:
    """Which part of a serving side a process is, from its title (Ray sets ``ray::<actor>``)."""
    command = " ".join(process.cmdline())
    if "benchmarks.vllm_frontend" in command:
        return "vLLM front end + engine"
    if "ServeReplica" in command:
        if ":ReplicaPicker" in command or ":LLMRouter" in command:  # direct streaming: HAProxy asks it
            return "replica picker"
        return "model replica"
    if "ProxyActor" in command:
        return "Serve proxy"
    if "haproxy" in process.name():  # RAY_SERVE_ENABLE_HA_PROXY: Serve's HAProxy in place of the proxy's HTTP
        return "HAProxy"
    if "ServeController" in command:
        return "Serve controller"
    return "Ray daemons and CLI"


def cpu_by_process(root_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of ``root_pid`` and every process below it, with each one's role."""
    root = psutil.Process(root_pid)
    seen = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            seen[process.pid] = (process_role(process), times.user + times.system)
        except psutil.Error:  # it ended meanwhile
            continue
    return seen


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role used between two readings (a process that started counts from 0)."""
    used: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        used[role] = used.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return used


def allowed_tokens_per_s(settings: SimulatedEngineConfig, max_num_seqs: int, streams: int, workload: Workload) -> float:
    """Tokens/s the timing model gives ``streams`` clients: a batch of min(streams, max_num_seqs) run to the end."""
    import random

    from serve_app.simulated_engine.batch import ContinuousBatch, SimSequence
    from serve_app.simulated_engine.timing import GpuTiming

    batch = ContinuousBatch(GpuTiming.from_config(settings), max_num_seqs, vocabulary=[0])
    running_at_once = min(streams, max_num_seqs)
    for i in range(running_at_once):
        batch.add(
            SimSequence(
                f"s{i}",
                workload.input_tokens,
                workload.output_tokens,
                10**9,
                0,
                None,
                None,
                frozenset(),
                random.Random(i),
                0.0,
            )
        )
    now, tokens = 0.0, 0
    while not batch.idle:
        step = batch.schedule(now)
        assert step is not None
        now = step.end_s
        tokens += len(batch.complete(step))
    return tokens / now


def measure(
    server: ServerCommand,
    workload: Workload,
    loads: list[Load],
    log: Path,
    allowed: Callable[[int], float],
    protocols: tuple[str, ...] = ("http",),
    endpoints: tuple[str, ...] = (),
) -> dict[str, dict[str, Any]]:
    """Each protocol's levels, one after the other on the same running server; with ``endpoints``,
    each endpoint's over HTTP (keyed ``http <endpoint>``), the same workload otherwise."""
    print(f"\n== {server.name} (log: {log})", flush=True)
    sides = [(p, workload, p) for p in protocols]
    if endpoints:
        sides = [("http", replace(workload, endpoint=e), f"http {e}") for e in endpoints]
    results = {}
    with running(server, log) as process:  # (serve run's process tree holds its whole local Ray cluster)
        for protocol, side_workload, key in sides:
            clients = client_pool(protocol, server.url, server.grpc_target or "", None)
            results[key] = asyncio.run(measure_levels(clients, process.pid, side_workload, loads, allowed))
            results[key] |= {"url": server.url, "protocol": protocol}
    return results


async def measure_levels(
    clients: ClientPool, pid: int, workload: Workload, loads: list[Load], allowed: Callable[[int], float]
) -> dict[str, Any]:
    levels = []
    try:
        await run_load(clients, workload, Load(requests=4, concurrency=1))  # warm up
        for load in loads:
            before, client_before = cpu_by_process(pid), time.process_time()
            started = time.perf_counter()
            records = await run_load(clients, workload, load)
            wall = time.perf_counter() - started
            used = cpu_used(before, cpu_by_process(pid))
            summary = summarize(load.as_dict(), records, wall)
            tokens = sum(r.output_tokens for r in records if r.ok)
            assert load.concurrency is not None
            limit = allowed(load.concurrency)
            summary |= {
                "allowed_tokens_per_s": limit,
                "share_of_allowed": summary["output_tokens_per_s"] / limit,
                "cpu_s": used,
                "client_cpu_s": time.process_time() - client_before,
                "cpu_s_per_1k_tokens": {role: 1000 * s / tokens for role, s in used.items()} if tokens else {},
                "server_cpu_s_per_1k_tokens": 1000 * sum(used.values()) / tokens if tokens else None,
            }
            levels.append(summary | {"records": [record_dict(r) for r in records]})
    finally:
        await clients.aclose()
    return {"workload": workload.__dict__, "levels": levels}


def level_at(result: dict[str, Any], concurrency: int) -> dict[str, Any]:
    return next(lv for lv in result["levels"] if lv["load"]["concurrency"] == concurrency)


def print_levels(name: str, result: dict[str, Any]) -> None:
    print(f"\n{name}")
    print(
        f"{'streams':>8} {'ok':>5} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'gap p50':>8} {'gap p99':>8} "
        f"{'e2e p50':>9} {'tok/s':>8} {'allowed':>8} {'share':>6} {'cpu/1k':>7}  by process (cpu s / 1k tokens)"
    )
    for level in result["levels"]:
        per_role = ", ".join(f"{role} {v:.3f}" for role, v in sorted(level["cpu_s_per_1k_tokens"].items()))
        ok = level["requests"] - level["failed"]
        cpu = level["server_cpu_s_per_1k_tokens"]
        ttft, gap = level["ttft_ms"], level["itl_ms"]
        print(
            f"{level['load']['concurrency']:>8} {ok:>5} {ttft['p50']:>9.1f} {ttft['p99']:>9.1f} "
            f"{level['tpot_ms']['p50']:>9.2f} {gap['p50']:>8.2f} {gap['p99']:>8.2f} {level['e2e_ms']['p50']:>9.1f} "
            f"{level['output_tokens_per_s']:>8.0f} {level['allowed_tokens_per_s']:>8.0f} "
            f"{level['share_of_allowed']:>6.0%} {'-' if cpu is None else f'{cpu:.3f}':>7}  {per_role}"
        )


def goals(vllm: dict[str, Any], app: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's goals, each with both sides' figures and whether it is met."""
    rows = []

    def add(goal: str, vllm_value: float, app_value: float, compared: float, target: str, met: bool) -> None:
        rows.append(
            {"goal": goal, "vllm": vllm_value, "app": app_value, "compared": compared, "target": target, "met": met}
        )

    v, a = level_at(vllm, 1)["ttft_ms"]["p50"], level_at(app, 1)["ttft_ms"]["p50"]
    add("TTFT p50 at 1 stream (ms)", v, a, a - v, "app <= vLLM + 5 ms", a - v <= 5)
    v, a = level_at(vllm, 16)["tpot_ms"]["p50"], level_at(app, 16)["tpot_ms"]["p50"]
    add("time per output token p50 at 16 (ms)", v, a, a - v, "app <= vLLM + 1 ms", a - v <= 1)
    for streams in (64, 256):
        v = level_at(vllm, streams)["server_cpu_s_per_1k_tokens"]
        a = level_at(app, streams)["server_cpu_s_per_1k_tokens"]
        add(f"CPU s per 1k tokens at {streams}", v, a, a / v, "app <= 1.5 x vLLM", a / v <= 1.5)
    level = level_at(app, 64)
    share = level["share_of_allowed"]
    add(
        "tokens/s at 64, share of the timing model",
        level_at(vllm, 64)["share_of_allowed"],
        share,
        share,
        "app >= 90%",
        share >= 0.9,
    )
    return rows


def direct_streaming_goals(vllm: dict[str, Any], app: dict[str, Any], rsl: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 39's goals: this app against vLLM's front end and Ray Serve LLM's direct streaming (``rsl``).

    Rows as :func:`goals` makes them, with the compared side's figure under ``vllm`` or ``rsl``.
    """
    rows: list[dict[str, Any]] = []

    def add(goal: str, side: str, theirs: float, ours: float, compared: float, target: str, met: bool) -> None:
        rows.append({"goal": goal, side: theirs, "app": ours, "compared": compared, "target": target, "met": met})

    v, a = level_at(vllm, 1)["ttft_ms"]["p50"], level_at(app, 1)["ttft_ms"]["p50"]
    add("TTFT p50 at 1 stream (ms)", "vllm", v, a, a - v, "app <= vLLM + 3 ms", a - v <= 3)
    levels = {lv["load"]["concurrency"] for lv in app["levels"]}
    for streams in sorted(levels & {64, 256}):
        a = level_at(app, streams)["server_cpu_s_per_1k_tokens"]
        r = level_at(rsl, streams)["server_cpu_s_per_1k_tokens"]
        v = level_at(vllm, streams)["server_cpu_s_per_1k_tokens"]
        add(f"CPU s per 1k tokens at {streams}", "rsl", r, a, a / r, "app <= 0.9 x RSL direct", a <= 0.9 * r)
        add(f"CPU s per 1k tokens at {streams}", "vllm", v, a, a / v, "app <= 2.5 x vLLM", a <= 2.5 * v)
        a, r = level_at(app, streams)["share_of_allowed"], level_at(rsl, streams)["share_of_allowed"]
        add(f"share of the timing model at {streams}", "rsl", r, a, a - r, "app >= RSL direct", a >= r)
    return rows


def print_goals(rows: list[dict[str, Any]]) -> None:
    """One line per goal: the compared side (vLLM's front end, or Ray Serve LLM direct: RSL) and this app."""
    print(f"\n{'goal':<44} {'side':>5} {'theirs':>9} {'app':>9} {'compared':>9}  {'target':<24} met")
    for row in rows:
        side = "vLLM" if "vllm" in row else "RSL"
        theirs = row.get("vllm", row.get("rsl"))
        print(
            f"{row['goal']:<44} {side:>5} {theirs:>9.3f} {row['app']:>9.3f} {row['compared']:>9.3f}  "
            f"{row['target']:<24} {'yes' if row['met'] else 'NO'}"
        )


def plot(vllm: dict[str, Any], app: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        ("time to first token p50 (ms)", lambda lv: lv["ttft_ms"]["p50"]),
        ("time per output token p50 (ms)", lambda lv: lv["tpot_ms"]["p50"]),
        ("delivered tokens / s", lambda lv: lv["output_tokens_per_s"]),
        ("serving CPU s per 1,000 tokens", lambda lv: lv["server_cpu_s_per_1k_tokens"]),
    )
    for axis, (title, value) in zip(axes.flat, panels, strict=True):
        for name, result, style in (("vLLM front end", vllm, "o-"), ("this app", app, "s-")):
            x = [lv["load"]["concurrency"] for lv in result["levels"]]
            axis.plot(x, [value(lv) for lv in result["levels"]], style, label=name)
        if title.startswith("delivered"):
            x = [lv["load"]["concurrency"] for lv in app["levels"]]
            axis.plot(x, [lv["allowed_tokens_per_s"] for lv in app["levels"]], "k--", label="timing model")
        axis.set(title=title, xlabel="concurrent streams", xscale="log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    workload = app["workload"]
    figure.suptitle(f"simulated engine, in {workload['input_tokens']} / out {workload['output_tokens']} tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.sim.yaml")
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--requests", type=int, help=f"per level (default: 2 x concurrency, at least {MIN_REQUESTS})")
    parser.add_argument("--out-dir", type=Path, help="write vllm.json, app.json, goals.json and overhead.png here")
    parser.add_argument(
        "--app-only", action="store_true", help="measure this app alone (trying a setting): no vLLM side, no goals"
    )
    parser.add_argument(
        "--app-env", nargs="+", default=[], metavar="NAME=VALUE", help="environment of this app's processes"
    )
    parser.add_argument(
        "--app-protocols",
        nargs="+",
        choices=["http", "grpc", "grpc-stream"],
        default=["http"],
        help="measure this app over each, one after the other (gRPC: app-grpc.json, a call per request;"
        " grpc-stream: app-grpc-stream.json, every request on one multiplexed call; compare on --endpoint chat)",
    )
    parser.add_argument("--endpoint", choices=["completions", "chat", "responses"], default="completions")
    parser.add_argument(
        "--app-endpoints",
        nargs="+",
        choices=["completions", "chat", "responses"],
        default=[],
        help="with --app-only: measure each over HTTP, one after the other on the same app (app-<endpoint>.json)",
    )
    parser.add_argument(
        "--ray-serve-llm",
        action="store_true",
        help="also measure Ray Serve LLM's direct streaming on the same simulated engine, after this app "
        "(ray-serve-llm.json, and issue 39's goals against it)",
    )
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    _, entry = app_entry(config, None)
    if "simulated_engine" not in entry:
        raise SystemExit(f"{args.config}: the model has no simulated_engine section")
    settings = SimulatedEngineConfig.model_validate(sized_for(entry["simulated_engine"] or {}, entry["engine_args"]))
    max_num_seqs = entry["engine_args"]["max_num_seqs"]
    workload = Workload(entry["name"], args.input_tokens, args.output_tokens, args.endpoint)
    protocols = tuple(args.app_protocols)
    loads = [Load(requests=args.requests or max(MIN_REQUESTS, 2 * c), concurrency=c) for c in args.concurrency]

    def allowed(streams: int) -> float:
        return allowed_tokens_per_s(settings, max_num_seqs, streams, workload)

    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        workdir = Path(tmp)
        logs = args.out_dir or workdir
        logs.mkdir(parents=True, exist_ok=True)
        app_server = this_app(config, None, workdir, REPO)
        app_server = replace(app_server, env=app_server.env | dict(pair.split("=", 1) for pair in args.app_env))
        if args.app_only:
            endpoints = tuple(args.app_endpoints)
            by_protocol = measure(app_server, workload, loads, logs / "app.log", allowed, protocols, endpoints)
            for protocol, result in by_protocol.items():
                print_levels(f"this app over {protocol} {' '.join(args.app_env)}", result)
                if args.out_dir:
                    name = "app.json" if protocol == "http" else f"app-{protocol.replace('http ', '')}.json"
                    (args.out_dir / name).write_text(json.dumps(result, indent=1))
            return {"app": by_protocol.get("http"), "app_by_protocol": by_protocol}
        vllm = measure(simulated_vllm(config, None, workdir, REPO), workload, loads, logs / "vllm.log", allowed)["http"]
        print_levels("vLLM's front end", vllm)
        app = measure(app_server, workload, loads, logs / "app.log", allowed)["http"]
        print_levels("this app (one model replica)", app)
        rsl = None
        if args.ray_serve_llm:
            rsl_server = ray_serve_llm_direct(config, None, workdir, REPO)
            rsl = measure(rsl_server, workload, loads, logs / "ray-serve-llm.log", allowed)["http"]
            print_levels("Ray Serve LLM, direct streaming", rsl)
    rows = goals(vllm, app) if any(lv["load"]["concurrency"] == 16 for lv in app["levels"]) else []
    direct_rows = direct_streaming_goals(vllm, app, rsl) if rsl is not None else []
    print_levels("vLLM's front end", vllm)
    print_goals(rows + direct_rows)
    if args.out_dir:
        (args.out_dir / "vllm.json").write_text(json.dumps(vllm, indent=1))
        (args.out_dir / "app.json").write_text(json.dumps(app, indent=1))
        if rsl is not None:
            (args.out_dir / "ray-serve-llm.json").write_text(json.dumps(rsl, indent=1))
        all_goals = {"config": str(args.config), "goals": rows + direct_rows}
        (args.out_dir / "goals.json").write_text(json.dumps(all_goals, indent=1))
        plot(vllm, app, args.out_dir / "overhead.png")
    return {"vllm": vllm, "app": app, "ray_serve_llm": rsl, "goals": rows + direct_rows}


if __name__ == "__main__":
    main()
