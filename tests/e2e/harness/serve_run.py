"""`serve run` of a serve config on one of the suite's Ray clusters: start it, wait for it, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness.apps import REPO
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
