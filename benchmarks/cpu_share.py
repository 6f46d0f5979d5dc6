"""Bare vLLM alone, then next to a process that keeps part of one core busy; the goal's figures compared.

    python -m benchmarks.cpu_share --busy-fraction 0.5 --out-dir bench/

On a machine where vLLM's CPU engine uses every core (its worker computes while its
engine core polls for the result), any other process's CPU time is taken from the
engine's steps. This measures how much: the side-by-side goal's three figures for bare
vLLM with a competitor that does nothing but spin for ``--busy-fraction`` of every 10 ms,
against bare vLLM alone: what a serving layer's CPU share alone costs on those cores,
before any latency its hops add.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from benchmarks.client import Workload
from benchmarks.load import Load, print_table, run
from benchmarks.servers import app_entry, bare_vllm, running
from benchmarks.side_by_side import REPO, compare, print_comparison

# Spin for `fraction` of each 10 ms period, sleep the rest: a steady share of one core.
_SPIN = """
import sys, time
busy = 0.01 * float(sys.argv[1])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(0.01 - busy)
"""


@contextmanager
def busy_process(fraction: float) -> Iterator[subprocess.Popen | None]:
    """A process that keeps ``fraction`` of one core busy until the block ends (none for 0)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"busy fraction must be within [0, 1], got {fraction}")
    if fraction == 0:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(fraction)], start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.cpu.yaml", help="a serve config")
    parser.add_argument("--model", help="the model entry to serve (default: the config's first)")
    parser.add_argument("--busy-fraction", type=float, default=0.5, help="of one core, for the competitor")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out-dir", type=Path, help="write alone.json, shared.json and comparison.json here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    _, entry = app_entry(config, args.model)
    workload = Workload(entry["name"], 32, 64)  # the side-by-side's workload
    loads = [Load(requests=max(32, 4 * c), concurrency=c) for c in args.concurrency]
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cpu-share-") as tmp:
        logs = args.out_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        server = bare_vllm(config, args.model, Path(tmp), REPO)
        with running(server, logs / "bare.log"):
            for name, fraction in (("alone", 0.0), ("shared", args.busy_fraction)):
                print(f"\n== bare vLLM, competitor busy {fraction:.0%} of one core", flush=True)
                with busy_process(fraction):
                    measured[name] = asyncio.run(run(server.url, workload, loads, api_key=None, warmup=4))
                print_table(measured[name])
    rows = compare(measured["alone"], measured["shared"])
    print_comparison(rows, labels=("alone", f"busy {args.busy_fraction:.0%}"))
    # In the rows, "bare" is bare vLLM alone and "app" is bare vLLM next to the competitor.
    result = {"config": str(args.config), "busy_fraction": args.busy_fraction, "comparison": rows}
    if args.out_dir:
        for name, levels in measured.items():
            (args.out_dir / f"{name}.json").write_text(json.dumps(levels, indent=1))
        (args.out_dir / "comparison.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
