"""`serve run` of a serve config on one of the suite's Ray clusters: start it, wait for it, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.harness.apps import REPO
from tests.e2e.harness.ray_cluster import RayCluster
from tests.waiting import wait_until_blocking


def start_serve_run(address: str, config_path: Path, log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """``serve run --address <address> <config>`` in a session of its own, its output in ``log_path``."""
    serve_cli = Path(sys.executable).with_name("serve")
    with log_path.open("w") as log:
        return subprocess.Popen(
            [str(serve_cli), "run", "--address", address, str(config_path)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def all_healthy(urls: list[str]) -> bool:
    """Whether every application's ``/health`` answers 200."""
    async with httpx.AsyncClient(timeout=5) as client:
        try:
            return all([(await client.get(f"{url}/health")).status_code == 200 for url in urls])
        except httpx.TransportError:
            return False


def wait_until_healthy(urls: list[str], proc: subprocess.Popen, log_path: Path, within_s: float) -> None:
    """Until every application's ``/health`` answers 200; a failure if `serve run` exits first."""

    def healthy() -> bool:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])
            pytest.fail(f"serve run exited with {proc.returncode} before the apps were healthy:\n{tail}")
        try:
            return all(httpx.get(f"{url}/health", timeout=5).status_code == 200 for url in urls)
        except httpx.TransportError:
            return False

    wait_until_blocking(healthy, within_s, f"{urls} healthy", every_s=1)


def stop(proc: subprocess.Popen) -> None:
    """End `serve run` without Serve's graceful shutdown: the cluster's stop that follows ends every
    replica, its engine processes and Serve's HAProxy with it (1.8 s; a shutdown through Serve's REST
    API first took 12 to 35 s, and no test proves anything by it)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def serve_run_alone(suite: dict[str, Any], app: dict[str, Any], workdir: Path, within_s: float) -> Iterator[str]:
    """``app`` alone, of the suite's config ``suite``, under a bare ``serve run`` on a Ray cluster of
    its own (Ray's defaults, but for the node's own drain at its stop: 30 s, and nothing is left to
    move by then); yields its URL once it is healthy, and stops it all after."""
    config_path, log_path = workdir / "config.yaml", workdir / "serve.log"
    config_path.write_text(yaml.safe_dump(suite | {"applications": [app]}, sort_keys=False))
    url = f"http://127.0.0.1:{suite['http_options']['port']}{app['route_prefix']}"
    cluster = RayCluster(settings={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        cluster.start()
        proc = start_serve_run(cluster.address, config_path, log_path, os.environ | cluster.env)
        try:
            wait_until_healthy([url], proc, log_path, within_s)
            yield url
        finally:
            stop(proc)
    finally:
        cluster.stop()
