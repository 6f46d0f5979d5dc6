"""Reading Serve's view of the app from a test process joined to its cluster.

The app autoscales, so a test that reads one replica's engine (through a Serve
handle, which reaches one replica per call) first waits until the deployment is
back to a single running replica; ``single_replica`` is that wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from ray import serve
from ray.util.state import list_actors

# Longest a scaled-out deployment takes to settle at one replica again: a starting
# engine finishes loading (about a minute on 2 cores), the 60 s downscale delay,
# then the extra replica drains.
SETTLE_S = 300


class DeploymentName:
    """Names a deployment for the helpers here, as a handle would (``app_name``, ``deployment_name``)."""

    def __init__(self, app_name: str, deployment_name: str) -> None:
        self.app_name, self.deployment_name = app_name, deployment_name


async def serve_deploy(config: Path, dashboard_url: str) -> None:
    """``serve deploy`` the config to the running cluster, as an operator would."""
    deploy = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("serve")),
        "deploy",
        str(config),
        "--address",
        dashboard_url,
        env=os.environ | {"RAY_AUTH_MODE": "token"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output, _ = await deploy.communicate()
    assert deploy.returncode == 0, output.decode()


async def deployment_status(handle: Any) -> Any:
    """The deployment's status overview, or None while its application is being (re)built.

    ``handle`` is anything with ``app_name`` and ``deployment_name``, such as a Serve handle.
    """
    status = await asyncio.to_thread(serve.status)
    application = status.applications.get(handle.app_name)
    return application.deployments.get(handle.deployment_name) if application else None


async def replica_states(handle: Any) -> dict[str, int]:
    deployment = await deployment_status(handle)
    return dict(deployment.replica_states) if deployment else {}


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Poll ``condition`` until it holds; return the seconds it took."""
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout_s, f"not {what} after {timeout_s:.0f} s"
        await asyncio.sleep(0.5)  # poll interval of the condition above
    return time.monotonic() - start


async def running(handle: Any, count: int) -> bool:
    """At least ``count`` replicas are running (others may be starting or stopping)."""
    return (await replica_states(handle)).get("RUNNING", 0) >= count


async def only_one_running(handle: Any) -> bool:
    """Exactly one replica, running, and the deployment healthy: nothing starting or draining."""
    deployment = await deployment_status(handle)
    return (
        deployment is not None and deployment.status == "HEALTHY" and dict(deployment.replica_states) == {"RUNNING": 1}
    )


async def serving_alone(handle: Any) -> bool:
    """One running replica whose engine is alive (Serve marks a dead one only after 3 failed checks)."""
    if not await only_one_running(handle):
        return False
    try:
        await asyncio.wait_for(handle.ping.remote(), timeout=10)
    except Exception:
        return False
    return True


async def single_replica(handle: Any) -> float:
    """Wait until the deployment is at one running replica with a live engine; return the seconds it took."""
    return await wait_until(lambda: serving_alone(handle), timeout_s=SETTLE_S, what="at one running, live replica")


async def a_busy_replica(handle: Any, replicas: set[str], held: int = 8, within_s: float = 120) -> str:
    """The actor id of one of ``replicas`` whose engine holds at least ``held`` requests.

    Serve's router may leave one replica idle for a while (its queue-length probes time
    out on busy cores); killing an idle engine would prove nothing about held requests.
    """
    start = time.monotonic()
    while True:
        replica, holds = await handle.engine_load.remote()
        if replica in replicas and holds >= held:
            return replica
        assert time.monotonic() - start < within_s, f"no replica seen holding {held} requests in {within_s:.0f} s"
        await asyncio.sleep(0.2)  # poll interval of the condition above


def ongoing_at(actor_id: str) -> int:
    """Requests one replica is answering, asked of its Ray actor directly.

    This is Serve's own queue-length probe (``get_num_ongoing_requests``, what its
    routers ask each replica): unlike a call through a handle, it cannot be routed
    to another replica. Blocking: call it through ``asyncio.to_thread``.
    """
    import ray

    (actor,) = list_actors(filters=[("actor_id", "=", actor_id)])
    replica = ray.get_actor(actor.name, namespace=actor.ray_namespace)
    return ray.get(replica.get_num_ongoing_requests.remote(), timeout=30)


def live_replicas(handle: Any) -> dict[str, str]:
    """The deployment's live replica actors: actor id -> node id.

    Blocking (it asks Ray's state API): call it through ``asyncio.to_thread``.
    """
    replica_class = f"ServeReplica:{handle.app_name}:{handle.deployment_name}"
    actors = list_actors(filters=[("class_name", "=", replica_class), ("state", "=", "ALIVE")])
    return {actor.actor_id: actor.node_id for actor in actors}


def replica_engines(handle: Any) -> dict[str, list[psutil.Process]]:
    """The vLLM engine-core processes of each live replica of the deployment, by replica actor id.

    Blocking (it asks Ray's state API): call it through ``asyncio.to_thread``.
    """
    replica_class = f"ServeReplica:{handle.app_name}:{handle.deployment_name}"
    replicas = list_actors(filters=[("class_name", "=", replica_class), ("state", "=", "ALIVE")])
    return {
        replica.actor_id: [
            child
            for child in psutil.Process(replica.pid).children(recursive=True)
            if "EngineCore" in " ".join(child.cmdline())
        ]
        for replica in replicas
    }


@contextlib.contextmanager
def stopped(processes: list[psutil.Process]) -> Iterator[None]:
    """Freeze ``processes`` (SIGSTOP) for the block and continue them (SIGCONT) after, whatever happens.

    A frozen engine core takes requests (its client queues them) and produces nothing,
    so what it holds cannot finish while a test sets up what it measures.
    """
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


def death_reason(actor_id: str) -> str | None:
    """Why Ray says a (dead) actor died, e.g. ``WORKER_DIED`` or ``RAY_KILL``; None while it lives.

    Blocking (it asks Ray's state API): call it through ``asyncio.to_thread``.
    """
    (actor,) = list_actors(filters=[("actor_id", "=", actor_id)], detail=True)
    if actor.state != "DEAD":
        return None
    return (actor.death_cause or {}).get("actor_died_error_context", {}).get("reason")


def request_log_lines(session_dir: str, deployment: str = "Ingress") -> dict[str, dict[str, Any]]:
    """The ingress's one JSON line per request, by the request's id (the client's ``X-Request-Id``).

    Read from every ingress replica's Serve log in the session's log directory,
    as an operator would. Blocking: call it through ``asyncio.to_thread``.
    """
    lines = {}
    for path in Path(session_dir, "logs", "serve").glob(f"replica_*_{deployment}_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            head, sep, payload = line.partition(' -- {"event":"request"')
            if sep:
                request_id = head.split()[-1]
                lines[request_id] = json.loads('{"event":"request"' + payload)
    return lines
