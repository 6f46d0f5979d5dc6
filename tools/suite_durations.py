"""Per-module time of a test run, from pytest's ``--durations=0`` report: the table docs/testing.md keeps.

    .venv/bin/python -m pytest --durations=0 ... > run.log
    python -m tools.suite_durations run.log

Each module's setup, call and teardown seconds are summed (a session fixture's setup and
teardown land on the test that first or last used it, as pytest reports them), then printed as a
Markdown table, slowest first.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?)::")


def module_seconds(report: str) -> dict[str, dict[str, float]]:
    """Seconds by module, then by phase (setup, call, teardown), from the durations lines."""
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    for line in report.splitlines():
        match = _LINE.match(line)
        if match:
            value, phase, module = match.groups()
            seconds[module][phase] += float(value)
    return dict(seconds)


def table(seconds: dict[str, dict[str, float]]) -> str:
    rows = sorted(seconds.items(), key=lambda item: -sum(item[1].values()))
    lines = ["| module | setup s | call s | teardown s | total s |", "|---|---:|---:|---:|---:|"]
    for module, phases in rows:
        total = sum(phases.values())
        lines.append(
            f"| `{module}` | {phases['setup']:.0f} | {phases['call']:.0f} | {phases['teardown']:.0f} | {total:.0f} |"
        )
    overall = {phase: sum(p[phase] for p in seconds.values()) for phase in ("setup", "call", "teardown")}
    lines.append(
        f"| all | {overall['setup']:.0f} | {overall['call']:.0f} | {overall['teardown']:.0f} | "
        f"{sum(overall.values()):.0f} |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(module_seconds(Path(sys.argv[1]).read_text(errors="replace"))))
