"""The Ray cluster's environment from ``deploy/cluster.env``: Serve settings read when Ray starts.

Serve's controller reads settings such as ``RAY_SERVE_ENABLE_HA_PROXY`` when it
starts its proxies, so they go to every process Ray starts, not to an
application's ``runtime_env``. One file feeds ``make serve`` (``python -m
tools.cluster_env`` prints ``NAME=VALUE`` words for ``env``), the test suite's
cluster, the benchmarks and, checked by a unit test, the RayService.
"""

from __future__ import annotations

import sys
from pathlib import Path

CLUSTER_ENV = Path(__file__).resolve().parents[1] / "deploy" / "cluster.env"


def parse(text: str) -> dict[str, str]:
    """``NAME=VALUE`` lines; blank lines and ``#`` comments skipped; no quoting or expansion."""
    env = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.isidentifier() or " " in value:
            raise ValueError(f"line {number}: expected NAME=VALUE, got {line!r}")
        env[name] = value
    return env


def cluster_env(path: Path = CLUSTER_ENV) -> dict[str, str]:
    return parse(path.read_text())


if __name__ == "__main__":
    env = cluster_env(Path(sys.argv[1]) if sys.argv[1:] else CLUSTER_ENV)
    print(" ".join(f"{name}={value}" for name, value in env.items()))
