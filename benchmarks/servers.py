"""Start and stop the two servers the side-by-side benchmark compares, from one serve config.

Both get the same engine arguments and the same environment variables (the serve config's
``runtime_env.env_vars``), so the only difference measured is the serving layer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from serve_app.config import sized_for
from serve_app.simulated_engine import FINGERPRINT as SIMULATED_FINGERPRINT
from tools.cluster_env import cluster_env

START_TIMEOUT_S = 600


@dataclass(frozen=True)
class ServerCommand:
    """A server to start: its command line, environment, working directory and URL."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    url: str
    health_path: str
    grpc_target: str | None = None  # this app's gRPC API, host:port


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_entry(config: dict[str, Any], model: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (application, model) entries of a serve config: the first model unless one is named."""
    for application in config["applications"]:
        for entry in application["args"]["models"]:
            if model is None or entry["name"] == model:
                return application, entry
    raise SystemExit(f"no model named {model!r} in the serve config")


def bare_vllm(config: dict[str, Any], model: str | None, workdir: Path, cwd: Path) -> ServerCommand:
    """vLLM's own OpenAI server with the model's ``engine_args`` (passed as vLLM's ``--config`` YAML)."""
    application, entry = app_entry(config, model)
    engine_args = workdir / "engine_args.yaml"
    engine_args.write_text(yaml.safe_dump(entry["engine_args"], sort_keys=False))
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--config",
        str(engine_args),
        "--served-model-name",
        entry["name"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ]
    return ServerCommand("bare vLLM", argv, runtime_env_vars(application), cwd, f"http://127.0.0.1:{port}", "/health")


def simulated_vllm(config: dict[str, Any], model: str | None, workdir: Path, cwd: Path) -> ServerCommand:
    """vLLM's own OpenAI server, as :func:`bare_vllm` starts it, on the model's simulated engine."""
    bare = bare_vllm(config, model, workdir, cwd)
    _, entry = app_entry(config, model)
    simulated = json.dumps(sized_for(entry.get("simulated_engine") or {}, entry["engine_args"]))
    vllm_args = bare.argv[3:] + ["--fingerprint-mode", "custom", "--fingerprint-value", SIMULATED_FINGERPRINT]
    argv = [sys.executable, "-m", "benchmarks.vllm_frontend", "--simulated-engine", simulated, "--", *vllm_args]
    return ServerCommand("vLLM's front end", argv, bare.env, cwd, bare.url, bare.health_path)


def this_app(config: dict[str, Any], model: str | None, workdir: Path, cwd: Path) -> ServerCommand:
    """``serve run`` on a copy of the config with one replica of everything, no API keys, and
    stored responses in that replica's memory.

    One replica each, so both sides run one engine (autoscaling would add a second engine
    mid-run); no keys, because bare vLLM is measured without them.
    """
    application, entry = app_entry(config, model)
    port, grpc_port = free_port(), free_port()
    pinned = dict(config, http_options=dict(config.get("http_options") or {}, host="127.0.0.1", port=port))
    if "grpc_options" in config:
        pinned["grpc_options"] = dict(config["grpc_options"], port=grpc_port)
    app = dict(application, args=dict(application["args"]))
    app["args"]["models"] = [pin_one_replica(entry)]
    ingress = {k: v for k, v in (app["args"].get("ingress") or {}).items() if k != "api_keys"}
    # One replica keeps stored responses in its own memory: no Redis beside the measured app.
    if "responses_store" in ingress:
        ingress["responses_store"] = {k: v for k, v in ingress["responses_store"].items() if k != "redis"}
    app["args"]["ingress"] = ingress
    pinned["applications"] = [app]
    path = workdir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(pinned, sort_keys=False))
    serve = Path(sys.executable).with_name("serve")
    url, grpc_target = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}" if "grpc_options" in config else None
    argv = [str(serve), "run", str(path)]  # a local Ray cluster, started with Serve's cluster settings
    return ServerCommand("this app", argv, cluster_env(), cwd, url, "/health", grpc_target)


def pin_one_replica(entry: dict[str, Any]) -> dict[str, Any]:
    deployment = {k: v for k, v in (entry.get("deployment") or {}).items() if k != "autoscaling_config"}
    pinned = dict(entry, deployment=deployment | {"num_replicas": 1})
    if "simulated_engine" in entry:  # measured, not its start: no model load time
        pinned["simulated_engine"] = dict(entry["simulated_engine"] or {}, load_s=0)
    return pinned


def runtime_env_vars(application: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in ((application.get("runtime_env") or {}).get("env_vars") or {}).items()}


@contextmanager
def running(server: ServerCommand, log_path: Path) -> Iterator[subprocess.Popen]:
    """The server's process, started and healthy; stopped (its whole process group) on leaving."""
    started_at = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            server.argv,
            cwd=server.cwd,
            env=os.environ | server.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until_healthy(server, proc, log_path)
        yield proc
    finally:
        stop(proc)
        stop_haproxy_started_since(started_at)


def wait_until_healthy(server: ServerCommand, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {proc.returncode}; log: {log_path}\n{tail(log_path)}")
        try:
            if httpx.get(server.url + server.health_path, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)  # poll interval of the condition above
    raise RuntimeError(f"{server.name} not healthy after {START_TIMEOUT_S} s; log: {log_path}\n{tail(log_path)}")


def stop(proc: subprocess.Popen, timeout_s: float = 90) -> None:
    """SIGINT (``serve run`` then shuts its local Ray cluster down), SIGKILL to the group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    try:  # whatever it left behind in its group would take CPU from the next measurement
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_haproxy_started_since(started_at: float) -> None:
    """Kill the HAProxy processes Serve started for this server: its manager starts each in a
    session of its own, so the process group's kill misses them, and one left listening takes
    the next server's stats and metrics ports (8404, 9101), which fails its HAProxy's start."""
    for process in psutil.process_iter(["name", "create_time"]):
        if process.info["name"] == "haproxy" and process.info["create_time"] >= started_at:
            try:
                process.kill()
                process.wait(timeout=10)
            except psutil.NoSuchProcess:
                pass


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
