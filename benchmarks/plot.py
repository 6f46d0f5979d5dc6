"""Latency percentiles and throughput against load, as one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def plot_levels(result: dict[str, Any], path: Path) -> None:
    levels = result["levels"]
    by_rate = levels[0]["load"]["concurrency"] is None
    x = [level["load"]["rate" if by_rate else "concurrency"] for level in levels]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for metric, style in (("ttft_ms", "o-"), ("e2e_ms", "s-"), ("tpot_ms", "^-")):
        for p, alpha in (("p50", 1.0), ("p99", 0.45)):
            y = [level[metric][p] for level in levels]
            latency.plot(x, y, style, alpha=alpha, label=f"{metric[:-3]} {p}")
    latency.set(
        xlabel="requests per second" if by_rate else "concurrent streams", ylabel="ms", yscale="log", title="latency"
    )
    latency.legend(fontsize=8)
    throughput.plot(x, [level["output_tokens_per_s"] for level in levels], "o-")
    throughput.set(xlabel=latency.get_xlabel(), ylabel="output tokens / s", title="throughput")
    for axis in (latency, throughput):
        axis.grid(alpha=0.3)
        if not by_rate:
            axis.set_xscale("log", base=2)
    workload = result["workload"]
    figure.suptitle(
        f"{result['url']}  {workload['model']}  in {workload['input_tokens']} / out {workload['output_tokens']} tokens"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
