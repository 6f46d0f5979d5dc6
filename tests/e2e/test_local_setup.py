"""Ray's token authentication, locally, as the README shows it; the suite leaves the user's Ray alone.

The suite's cluster is started as `make serve` starts one (token authentication
on), but with its own temp dir, ports and token (tests/e2e/harness/ray_cluster.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.e2e.conftest import USER_TOKEN_AT_START, token_file_state

SERVE = Path(sys.executable).with_name("serve")
RAY = Path(sys.executable).with_name("ray")
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def without_auth() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in AUTH_VARS}


def test_the_users_ray_token_file_is_untouched(app, cluster):
    """Starting the suite's cluster and joining it neither created nor rewrote ~/.ray/auth_token."""
    assert token_file_state() == USER_TOKEN_AT_START


def test_the_suite_runs_in_its_own_cluster(cluster, ray_cluster):
    import ray

    session_dir = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    assert session_dir.is_relative_to(ray_cluster.root)


def test_serve_status_needs_the_token_and_works_with_it(app, ray_cluster):
    """The README's decision: token authentication on; `serve status` works with RAY_AUTH_MODE=token."""
    refused = run([str(SERVE), "status", "--address", ray_cluster.dashboard_url], without_auth())
    assert refused.returncode != 0
    assert "Authentication required" in refused.stdout + refused.stderr, refused.stdout + refused.stderr
    env = without_auth() | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_cluster.token_path)}
    status = run([str(SERVE), "status", "--address", ray_cluster.dashboard_url], env)
    assert status.returncode == 0, status.stderr
    assert "glm:" in status.stdout and "RUNNING" in status.stdout
    ray_status = run([str(RAY), "status", "--address", ray_cluster.address], env)
    assert ray_status.returncode == 0 and "Active:" in ray_status.stdout, ray_status.stderr


def test_the_ready_line_names_the_url_and_the_models_of_each_app(app, serving):
    ready = run([sys.executable, "-m", "tools.ready_line", str(app.config_path), "--timeout-s", "60"], os.environ)
    assert ready.returncode == 0, ready.stderr
    # The suite's config as it runs now, in its order (applications no later test uses are gone: conftest.py).
    running = yaml.safe_load(app.config_path.read_text())["applications"]
    assert ready.stdout.splitlines() == [
        f"ready: {serving[a['name']].url}/v1 serves {serving[a['name']].model}; stored responses live "
        f"{where_responses_live(a)} (Ctrl-C stops it)"
        for a in running
    ]


def where_responses_live(application: dict) -> str:
    """In Redis where the application's config names it (the bed and its variants), else in its replica."""
    store = application["args"]["ingress"].get("responses_store") or {}
    return "in Redis" if store.get("redis") is not None else "in the model replica's memory"
