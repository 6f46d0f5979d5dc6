"""Bare vLLM's OpenAI server, then this app, on the same engine arguments; print the ratios.

    python -m benchmarks.side_by_side --config deploy/config.cpu.yaml --out-dir bench/

Each server runs alone: bare vLLM is started with the model's ``engine_args`` from the
serve config, measured and stopped; then ``serve run`` starts this app on the same config
(one replica of each deployment, no API keys) and the same levels are measured. The three
figures the performance goal names are printed with their ratios and targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.client import Workload
from benchmarks.load import Load, print_table, run
from benchmarks.servers import app_entry, bare_vllm, running, this_app

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Goal:
    """One compared figure: which level and metric, how the two are combined, and the target."""

    name: str
    concurrency: int
    metric: str  # "ttft_ms", "e2e_ms" (their p50) or "output_tokens_per_s"
    kind: str  # "difference" (app - bare, ms) or "ratio" (app / bare)
    target: float
    at_most: bool  # the app's figure must be at most (True) or at least (False) the target

    def figure(self, level: dict[str, Any]) -> float:
        value = level[self.metric]
        return value["p50"] if isinstance(value, dict) else value

    def compare(self, bare: float, app: float) -> float:
        return app - bare if self.kind == "difference" else app / bare

    def met(self, compared: float) -> bool:
        return compared <= self.target if self.at_most else compared >= self.target


GOALS = (
    Goal("time to first token p50, 1 stream", 1, "ttft_ms", "difference", 10.0, at_most=True),
    Goal("end-to-end p50, 16 streams", 16, "e2e_ms", "ratio", 1.2, at_most=True),
    Goal("output tokens/s, 64 streams", 64, "output_tokens_per_s", "ratio", 0.85, at_most=False),
)


def compare(bare: dict[str, Any], app: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal's figures on both servers, their difference or ratio, and whether it is met."""
    rows = []
    for goal in GOALS:
        bare_level = level_at(bare, goal.concurrency)
        app_level = level_at(app, goal.concurrency)
        if bare_level is None or app_level is None:
            continue
        b, a = goal.figure(bare_level), goal.figure(app_level)
        compared = goal.compare(b, a)
        rows.append(
            {
                "goal": goal.name,
                "bare": b,
                "app": a,
                goal.kind: compared,
                "target": f"{'<=' if goal.at_most else '>='} {goal.target:g}",
                "met": goal.met(compared),
            }
        )
    return rows


def level_at(result: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    return next((lv for lv in result["levels"] if lv["load"]["concurrency"] == concurrency), None)


def print_comparison(rows: list[dict[str, Any]], labels: tuple[str, str] = ("bare vLLM", "this app")) -> None:
    print(f"\n{'figure':<38} {labels[0]:>10} {labels[1]:>10} {'compared':>16} {'target':>8}  met")
    for row in rows:
        compared = f"{row['difference']:+.1f} ms" if "difference" in row else f"{row['ratio']:.2f}x"
        print(
            f"{row['goal']:<38} {row['bare']:>10.1f} {row['app']:>10.1f} {compared:>16} {row['target']:>8}  "
            f"{'yes' if row['met'] else 'NO'}"
        )


def measure(server, workload: Workload, loads: list[Load], log: Path) -> dict[str, Any]:
    print(f"\n== {server.name}: {' '.join(server.argv[1:4])} ... (log: {log})", flush=True)
    with running(server, log):
        result = asyncio.run(run(server.url, workload, loads, api_key=None, warmup=4))
    print_table(result)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deploy" / "config.cpu.yaml", help="a serve config")
    parser.add_argument("--model", help="the model entry to serve (default: the config's first)")
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, help="per level (default: 4 x concurrency, at least 32)")
    parser.add_argument("--out-dir", type=Path, help="write bare.json, app.json, comparison.json and plots here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    _, entry = app_entry(config, args.model)
    workload = Workload(entry["name"], args.input_tokens, args.output_tokens)
    loads = [Load(requests=args.requests or max(32, 4 * c), concurrency=c) for c in args.concurrency]
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp:
        workdir = Path(tmp)
        logs = args.out_dir or workdir
        logs.mkdir(parents=True, exist_ok=True)
        bare = measure(bare_vllm(config, args.model, workdir, REPO), workload, loads, logs / "bare.log")
        app = measure(this_app(config, args.model, workdir, REPO), workload, loads, logs / "app.log")
    rows = compare(bare, app)
    print_comparison(rows)
    result = {"config": str(args.config), "workload": workload.__dict__, "comparison": rows}
    if args.out_dir:
        from benchmarks.plot import plot_levels

        for name, measured in (("bare", bare), ("app", app)):
            (args.out_dir / f"{name}.json").write_text(json.dumps(measured, indent=1))
            plot_levels(measured, args.out_dir / f"{name}.png")
        (args.out_dir / "comparison.json").write_text(json.dumps(result, indent=1))
    return result | {"bare": bare, "app": app}


if __name__ == "__main__":
    main()
