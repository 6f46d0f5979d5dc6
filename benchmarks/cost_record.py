"""The serving layer's cost against vLLM's own front end, as the ratios issue 79 holds it to.

    python -m benchmarks.cost_record --runs 3 --out-dir bench/cost --docs docs/performance.md

(``make bench-cost``.) Each run starts, one at a time and alone on the machine, vLLM's OpenAI
server on the simulated engine (``benchmarks.vllm_frontend``) and then this app (``serve run``,
one replica of each deployment: ``benchmarks.servers.this_app``), from one serve config. Chat, 32
prompt tokens and 256 streamed output tokens (``ignore_eos``), as ``benchmarks.serving_overhead``
measures it:

- vLLM and the app over HTTP at 1 and 64 concurrent streams, then vLLM's own ``/v1/responses`` at 64;
- then, on the same running app, at 64: ``/v1/responses``, the gRPC API with a call per request,
  and every request in flight on one multiplexed ``Stream`` call; and chat at 1 and 64 sent to the
  model replica's own HTTP port, past Serve's HAProxy and the ReplicaPicker (the port read as
  ``benchmarks.first_token_path`` reads it).

Ratios, each against its target (:data:`TARGETS`): first token p50 at 64 streams, app / vLLM; CPU
seconds per 1,000 delivered tokens at 64 (every process of the app, then its model replica alone) /
vLLM's one process; the first token at one stream, app - vLLM in ms; the model replica's CPU per
token on one ``Stream`` call / a call each; ``/v1/responses`` / chat on both figures at 64. This
machine is noisy, so the sides are compared within one run, never across runs. Reference figures
(:data:`REFERENCES`, no target) split them: the first token at the replica's own port against
vLLM's (the replica alone), and vLLM's own ``/v1/responses`` against its chat. A benchmark: it
reports, it asserts nothing. ``--docs`` rewrites the current-figures table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.client import Workload
from benchmarks.first_token_path import newest_haproxy_files, replica_port
from benchmarks.load import Load, client_pool
from benchmarks.servers import app_entry, running, simulated_vllm, this_app
from benchmarks.serving_overhead import allowed_tokens_per_s, level_at, measure_levels
from serve_app.config import SimulatedEngineConfig, sized_for

REPO = Path(__file__).resolve().parents[1]
STREAMS = 64
MODEL_REPLICA = "model replica"
TABLE_START, TABLE_END = "<!-- cost-record: start -->", "<!-- cost-record: end -->"

# name: (what it is, its unit, how it reads as met)
TARGETS: dict[str, tuple[str, str, Callable[[float], bool]]] = {
    "ttft_64": ("first token p50 at 64 streams, app / vLLM", "x", lambda r: r <= 1.1),
    "cpu_64": ("CPU s per 1k tokens at 64, whole app / vLLM", "x", lambda r: r <= 1.3),
    "cpu_64_model": ("CPU s per 1k tokens at 64, model replica / vLLM", "x", lambda r: r <= 1.0),
    "ttft_1_ms": ("first token p50 at 1 stream, app - vLLM", "ms", lambda d: d <= 2.0),
    "stream_call_cpu": ("model replica CPU per token, one Stream call / a call each", "x", lambda r: r <= 1.0),
    "responses_ttft": ("first token p50 at 64, /v1/responses / chat", "x", lambda r: r <= 1.05),
    "responses_cpu": ("CPU s per 1k tokens at 64, /v1/responses / chat", "x", lambda r: r <= 1.05),
}
TARGET_TEXT = {
    "ttft_64": "<= 1.1",
    "cpu_64": "<= 1.3",
    "cpu_64_model": "<= 1.0",
    "ttft_1_ms": "<= +2 ms",
    "stream_call_cpu": "<= 1.0",
    "responses_ttft": "<= 1.05",
    "responses_cpu": "<= 1.05",
}

# Figures that say where a ratio's cost lies; no target. name: (what it is, its unit)
REFERENCES: dict[str, tuple[str, str]] = {
    "replica_ttft_64": ("first token p50 at 64, at the model replica's own port / vLLM", "x"),
    "replica_ttft_1_ms": ("first token p50 at 1 stream, at the model replica's own port - vLLM", "ms"),
    "vllm_responses_ttft": ("vLLM's own: first token p50 at 64, /v1/responses / chat", "x"),
    "vllm_responses_cpu": ("vLLM's own: CPU s per 1k tokens at 64, /v1/responses / chat", "x"),
}


def references(vllm: dict[str, dict[str, Any]], app: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each figure of :data:`REFERENCES` from one run's levels (``vllm``: chat, responses; ``app``:
    as :func:`ratios` reads it, and replica: chat at the model replica's own port)."""
    chat, responses = level_at(vllm["chat"], STREAMS), level_at(vllm["responses"], STREAMS)
    return {
        "replica_ttft_64": level_at(app["replica"], STREAMS)["ttft_ms"]["p50"] / chat["ttft_ms"]["p50"],
        "replica_ttft_1_ms": level_at(app["replica"], 1)["ttft_ms"]["p50"]
        - level_at(vllm["chat"], 1)["ttft_ms"]["p50"],
        "vllm_responses_ttft": responses["ttft_ms"]["p50"] / chat["ttft_ms"]["p50"],
        "vllm_responses_cpu": responses["server_cpu_s_per_1k_tokens"] / chat["server_cpu_s_per_1k_tokens"],
    }


def ratios(vllm: dict[str, Any], app: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each ratio of :data:`TARGETS` from one run's levels (``app``: by side: chat, responses, grpc, grpc-stream)."""
    chat, responses = level_at(app["chat"], STREAMS), level_at(app["responses"], STREAMS)
    calls, stream = level_at(app["grpc"], STREAMS), level_at(app["grpc-stream"], STREAMS)
    ours, theirs = level_at(app["chat"], 1), level_at(vllm, 1)
    at_64 = level_at(vllm, STREAMS)
    vllm_cpu = at_64["server_cpu_s_per_1k_tokens"]
    return {
        "ttft_64": chat["ttft_ms"]["p50"] / at_64["ttft_ms"]["p50"],
        "cpu_64": chat["server_cpu_s_per_1k_tokens"] / vllm_cpu,
        "cpu_64_model": chat["cpu_s_per_1k_tokens"][MODEL_REPLICA] / vllm_cpu,
        "ttft_1_ms": ours["ttft_ms"]["p50"] - theirs["ttft_ms"]["p50"],
        "stream_call_cpu": stream["cpu_s_per_1k_tokens"][MODEL_REPLICA] / calls["cpu_s_per_1k_tokens"][MODEL_REPLICA],
        "responses_ttft": responses["ttft_ms"]["p50"] / chat["ttft_ms"]["p50"],
        "responses_cpu": responses["server_cpu_s_per_1k_tokens"] / chat["server_cpu_s_per_1k_tokens"],
    }


def one_run(config: dict[str, Any], logs: Path, requests_at_1: int) -> dict[str, Any]:
    """vLLM's two sides, then the app's five; each side's levels, the run's ratios and references."""
    _, entry = app_entry(config, None)
    settings = SimulatedEngineConfig.model_validate(sized_for(entry["simulated_engine"] or {}, entry["engine_args"]))
    chat = Workload(entry["name"], 32, 256, "chat")
    responses = Workload(chat.model, 32, 256, "responses")

    def allowed(streams: int) -> float:
        return allowed_tokens_per_s(settings, entry["engine_args"]["max_num_seqs"], streams, chat)

    both = [Load(requests=requests_at_1, concurrency=1), Load(requests=2 * STREAMS, concurrency=STREAMS)]
    at_64 = both[1:]
    with tempfile.TemporaryDirectory(prefix="cost-record-") as tmp:
        workdir = Path(tmp)
        vllm_server = simulated_vllm(config, None, workdir, REPO)
        vllm = {}
        with running(vllm_server, logs / "vllm.log") as process:
            for name, workload, loads in (("chat", chat, both), ("responses", responses, at_64)):
                clients = client_pool("http", vllm_server.url, "", None)
                vllm[name] = asyncio.run(measure_levels(clients, process.pid, workload, loads, allowed))
        app_server = this_app(config, None, workdir, REPO)
        started_at = time.time()
        sides = [
            ("chat", "http", chat, both),
            ("responses", "http", responses, at_64),
            ("grpc", "grpc", chat, at_64),
            ("grpc-stream", "grpc-stream", chat, at_64),
        ]
        app = {}
        with running(app_server, logs / "app.log") as process:
            for name, protocol, workload, loads in sides:
                clients = client_pool(protocol, app_server.url, app_server.grpc_target or "", None)
                app[name] = asyncio.run(measure_levels(clients, process.pid, workload, loads, allowed))
            replica = f"http://127.0.0.1:{replica_port(newest_haproxy_files(started_at)[0])}"
            app["replica"] = asyncio.run(
                measure_levels(client_pool("http", replica, "", None), process.pid, chat, both, allowed)
            )
    return {
        "vllm": vllm["chat"],
        "vllm_responses": vllm["responses"],
        "app": app,
        "ratios": ratios(vllm["chat"], app),
        "references": references(vllm, app),
    }


def machine() -> str:
    """This machine, as a table names it: its CPU model and cores."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def table(runs: list[dict[str, Any]], header: dict[str, str]) -> str:
    """The current-figures table: one row per ratio, one column per run, and the target."""
    lines = [
        f"Measured {header['date']} on {header['machine']}, commit {header['commit']}, with `{header['command']}`"
        f" (config {header['config']}; chat, 32 tokens in, 256 out, streamed).",
        "",
        "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | target | met in every run |",
        "|---|" + "---:|" * len(runs) + "---|---|",
    ]
    for name, (what, unit, met) in TARGETS.items():
        values = [run["ratios"][name] for run in runs]
        shown = [f"{v:+.1f} ms" if unit == "ms" else f"{v:.2f}x" for v in values]
        lines.append(
            f"| {what} | "
            + " | ".join(shown)
            + f" | {TARGET_TEXT[name]} | {'yes' if all(map(met, values)) else 'no'} |"
        )
    lines += [
        "",
        "Where the cost lies (no target):",
        "",
        "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
    ]
    lines += ["|---|" + "---:|" * len(runs)]
    for name, (what, unit) in REFERENCES.items():
        values = [run["references"][name] for run in runs]
        lines.append(
            f"| {what} | " + " | ".join(f"{v:+.1f} ms" if unit == "ms" else f"{v:.2f}x" for v in values) + " |"
        )
    lines += [
        "",
        "Each side's own figures at 64 streams (first token p50 ms; CPU s per 1k tokens, model replica's):",
        "",
    ]
    lines += ["| run | vLLM | app chat | app /v1/responses | app gRPC, a call each | app gRPC, one Stream call |"]
    lines += ["|---|---|---|---|---|---|"]
    for i, run in enumerate(runs):
        cells = [_cell(level_at(run["vllm"], STREAMS))]
        cells += [_cell(level_at(run["app"][side], STREAMS)) for side in ("chat", "responses", "grpc", "grpc-stream")]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(level: dict[str, Any]) -> str:
    model = level["cpu_s_per_1k_tokens"].get(MODEL_REPLICA)
    inner = f" ({model:.3f})" if model is not None else ""
    return f"{level['ttft_ms']['p50']:.0f} ms; {level['server_cpu_s_per_1k_tokens']:.3f}{inner}"


def write_docs(path: Path, text: str) -> None:
    """Replace what lies between the table's markers in ``path``."""
    doc = path.read_text()
    head, start, rest = doc.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not start or not end:
        raise SystemExit(f"{path}: no {TABLE_START} ... {TABLE_END} block")
    path.write_text(f"{head}{TABLE_START}\n{text}\n{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_record", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.sim.yaml")
    parser.add_argument("--runs", type=int, default=3, help="runs in a row (each: both sides, one at a time)")
    parser.add_argument("--requests-at-1", type=int, default=64, help="requests at one stream, per side")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "cost")
    parser.add_argument("--docs", type=Path, help="rewrite this file's current-figures table (docs/performance.md)")
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(args.runs):
        logs = args.out_dir / f"run-{i + 1}"
        logs.mkdir(exist_ok=True)
        run = one_run(config, logs, args.requests_at_1)
        (logs / "run.json").write_text(json.dumps(run, indent=1))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in run["ratios"].items()), flush=True)
        runs.append(run)
    header = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "commit": commit(),
        "command": "make bench-cost",
        "config": os.path.relpath(args.config.resolve(), REPO),
    }
    text = table(runs, header)
    print("\n" + text)
    (args.out_dir / "table.md").write_text(text + "\n")
    if args.docs:
        write_docs(args.docs, text)
    return runs


if __name__ == "__main__":
    main()
