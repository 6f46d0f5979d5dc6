"""Reading and driving Serve's view of an app from a test process joined to its cluster.

Replicas are reached one by one, by their Ray actors (:func:`call_replica`): a call
through a deployment handle lets Serve's router pick the replica and waits while every
replica is full, which is exactly when a load test needs to read one.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import pickle
import uuid
from collections import Counter
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from ray.serve._private.haproxy import HAProxyManager
from ray.serve.context import _get_global_client
from ray.util.state import list_actors

from tests.waiting import wait_until

# Longest a deployment takes to settle at one replica again: a starting CPU engine
# finishes loading (about a minute on 2 cores), the downscale delay, then the drain.
SETTLE_S = 300


class DeploymentName:
    """Names a deployment for the helpers here (``app_name``, ``deployment_name``)."""

    def __init__(self, app_name: str, deployment_name: str) -> None:
        self.app_name, self.deployment_name = app_name, deployment_name

    def __repr__(self) -> str:
        return f"{self.app_name}/{self.deployment_name}"


def serve_deploy_blocking(config: Path, dashboard_url: str) -> None:
    """Deploy the config to the running cluster as ``serve deploy`` does, through Ray's own client of
    Serve's REST API (in this process: no CLI process and Ray import per deploy)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
    from ray.serve.schema import ServeDeploySchema

    body = ServeDeploySchema.model_validate(yaml.safe_load(config.read_text())).model_dump(exclude_unset=True)
    ServeSubmissionClient(dashboard_url).deploy_applications(body)


async def serve_deploy(config: Path, dashboard_url: str) -> None:
    """:func:`serve_deploy_blocking` from a coroutine."""
    await asyncio.to_thread(serve_deploy_blocking, config, dashboard_url)


async def serve_deploy_preserving(config: Path, suite_config: Path, dashboard_url: str) -> None:
    """Deploy ``config``, a change to an application that a test leaves as it is (one no later test
    uses), and make it the suite's config from now on: a later test that restores the suite's
    applications (:func:`serve_deploy_settled` of ``suite_config``) then keeps the change rather
    than rolling that application back."""
    suite_config.write_text(config.read_text())
    await serve_deploy(suite_config, dashboard_url)


async def serve_retire(names: Set[str], suite_config: Path, dashboard_url: str) -> None:
    """Remove applications no later test uses from the suite's config and deploy that: Serve stops
    them while the next tests run (nothing waits for it), its controller tends fewer replicas from
    then on, and the suite's stop has less to stop."""
    config = yaml.safe_load(suite_config.read_text())
    config["applications"] = [a for a in config["applications"] if a["name"] not in names]
    suite_config.write_text(yaml.safe_dump(config, sort_keys=False))
    await serve_deploy(suite_config, dashboard_url)


async def serve_deploy_settled(
    config: Path, dashboard_url: str, settled: set[str] | None = None, within_s: float = SETTLE_S
) -> None:
    """``serve deploy`` the config and wait until it is what runs: its applications and no others, and
    those in ``settled`` (by default all of them) settled.

    A test that changed the shared apps restores them with this, so the next test never
    meets the last one's replicas (a replica still asking for API keys, say). A test that
    changed one application names it in ``settled``: another may stay unsettled for good (a
    test left its rate limiter unplaceable, :func:`serve_deploy_preserving`).
    """
    await serve_deploy(config, dashboard_url)
    names = {app["name"] for app in yaml.safe_load(config.read_text())["applications"]}
    waited = names if settled is None else settled
    await wait_until(lambda: only_these_settled(names, waited), within_s, f"the applications {sorted(waited)} settled")


@dataclass(frozen=True)
class DeploymentStatus:
    """A deployment as ``serve.status()`` shows it: its status and its replicas counted by state."""

    status: str  # HEALTHY, UPDATING, ...
    replica_states: dict[str, int]  # RUNNING, STARTING, STOPPING, ... -> how many


@dataclass(frozen=True)
class ApplicationStatus:
    status: str  # RUNNING, DEPLOYING, ...
    deployments: dict[str, DeploymentStatus]


def _value(field: Any) -> str:
    """A status or state from the controller's report, an enum member or its value, as its value."""
    return str(getattr(field, "value", field))


def _applications() -> dict[str, ApplicationStatus]:
    """What ``serve.status()`` says of each application, read from the dict it parses (the
    controller's report) without building its models: that parse cost the test process 0.4 s of
    CPU a call with the suite's applications, and the waits below ask several times a second
    (docs/testing.md). Blocking (one controller call)."""
    report = _get_global_client().get_serve_details().get("applications") or {}
    return {
        name: ApplicationStatus(
            _value(app.get("status")),
            {
                deployment_name: DeploymentStatus(
                    _value(deployment.get("status")),
                    dict(Counter(_value(replica["state"]) for replica in deployment.get("replicas") or [])),
                )
                for deployment_name, deployment in (app.get("deployments") or {}).items()
            },
        )
        for name, app in report.items()
    }


async def applications() -> dict[str, ApplicationStatus]:
    """:func:`_applications` from a coroutine."""
    return await asyncio.to_thread(_applications)


async def only_these_settled(app_names: set[str], settled: set[str]) -> bool:
    """Exactly these applications exist, and those in ``settled`` run their deployed config: every
    deployment healthy, its replicas running and none starting or updating (a stopping one gets no
    requests)."""
    apps = await applications()
    if set(apps) != app_names:
        return False
    return all(
        app.status == "RUNNING"
        and all(
            d.status == "HEALTHY" and set(d.replica_states) - {"STOPPING"} == {"RUNNING"}
            for d in app.deployments.values()
        )
        for name, app in apps.items()
        if name in settled
    )


async def deployment_status(deployment: DeploymentName) -> DeploymentStatus | None:
    """The deployment's status overview, or None while its application is being (re)built."""
    application = (await applications()).get(deployment.app_name)
    return application.deployments.get(deployment.deployment_name) if application else None


async def replica_states(deployment: DeploymentName) -> dict[str, int]:
    status = await deployment_status(deployment)
    return dict(status.replica_states) if status else {}


async def deployment_details(deployment: DeploymentName) -> dict[str, Any] | None:
    """What Serve's dashboard shows of the deployment: its config and each replica's id,
    actor and state; None while its application is being (re)built."""

    def details() -> dict[str, Any]:
        return _get_global_client().get_serve_details()

    application = (await asyncio.to_thread(details))["applications"].get(deployment.app_name)
    return application["deployments"].get(deployment.deployment_name) if application else None


async def running_replica_actors(deployment: DeploymentName) -> set[str]:
    """The actor ids of the replicas Serve routes to: running, neither starting nor stopping.

    A replica being replaced by a new version counts as running until Serve starts to
    stop it, but it is about to go; a test that needs replicas to stay waits for the
    deployment to settle first (:func:`serve_deploy_settled`).
    """
    details = await deployment_details(deployment)
    replicas = details["replicas"] if details else []
    return {replica["actor_id"] for replica in replicas if replica["state"] == "RUNNING"}


async def running(deployment: DeploymentName, count: int) -> bool:
    """At least ``count`` replicas are running (others may be starting or stopping)."""
    return (await replica_states(deployment)).get("RUNNING", 0) >= count


async def only_one_running(deployment: DeploymentName) -> bool:
    """Exactly one replica, running, and the deployment healthy: nothing starting or draining."""
    status = await deployment_status(deployment)
    return status is not None and status.status == "HEALTHY" and dict(status.replica_states) == {"RUNNING": 1}


async def running_live(deployment: DeploymentName, count: int) -> bool:
    """Exactly ``count`` replicas, running and alive, and the deployment healthy: nothing starting or draining."""
    status = await deployment_status(deployment)
    if status is None or status.status != "HEALTHY" or dict(status.replica_states) != {"RUNNING": count}:
        return False
    return len(await live_replicas(deployment)) == count


async def serving_alone(deployment: DeploymentName) -> bool:
    """One running replica whose engine answers (Serve marks a dead one only after failed checks)."""
    if not await only_one_running(deployment):
        return False
    replicas = await live_replicas(deployment)
    if len(replicas) != 1:  # (one still stopping is alive to Ray)
        return False
    try:
        await call_replica(next(iter(replicas)), "ping", timeout_s=10)
    except Exception:
        return False
    return True


async def single_replica(deployment: DeploymentName, within_s: float = SETTLE_S) -> str:
    """Wait until the deployment is at one running replica with a live engine; return its actor id."""
    await wait_until(lambda: serving_alone(deployment), within_s, f"{deployment} at one running, live replica")
    (replica,) = await live_replicas(deployment)
    return replica


# Where Serve's HAProxy manager writes its configuration, a directory per cluster (Ray 2.60:
# ray.serve._private.constants.RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's directory).
HAPROXY_DIR = Path("/tmp/haproxy-serve")


def haproxy_server_addresses(app_name: str, protocol: str = "http") -> dict[str, str]:
    """The servers of an app's HTTP (or gRPC) backend in the newest HAProxy configuration that has
    one: each server's name (as HAProxy's stats page names it) and the host:port of the replica's
    own HTTP (gRPC) server, where HAProxy forwards its requests."""
    backend = f"backend {HAProxyManager.get_safe_name(f'{protocol}-{app_name}')}\n"
    configs = [path for path in HAPROXY_DIR.glob("*/haproxy.cfg") if backend in path.read_text()]
    if not configs:
        return {}
    text = max(configs, key=lambda path: path.stat().st_mtime).read_text()
    section = text[text.index(backend) + len(backend) :]
    addresses = {}
    for line in section.splitlines():
        if line and not line.startswith(" "):
            break
        words = line.split()
        if words and words[0] == "server":
            addresses[words[1]] = words[2]
    return addresses


async def haproxy_servers_up(stats_url: str, deployment: DeploymentName) -> list[dict[str, str]]:
    """The deployment's replicas HAProxy holds up in its app's HTTP backend: their rows of HAProxy's
    stats page."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(stats_url)
    if response.status_code != 200:
        return []
    rows = csv.DictReader(io.StringIO(response.text.removeprefix("# ")))
    # Serve names each server after its replica's actor and each HTTP backend after its app.
    safe_name = HAProxyManager.get_safe_name
    server_prefix = safe_name(f"SERVE_REPLICA::{deployment.app_name}#{deployment.deployment_name}#")
    return [
        row
        for row in rows
        if row["pxname"] == safe_name(f"http-{deployment.app_name}")
        and row["svname"].startswith(server_prefix)
        and row["status"].startswith("UP")
    ]


async def haproxy_routes_to(stats_url: str, deployment: DeploymentName, count: int) -> bool:
    """HAProxy holds at least ``count`` of the deployment's replicas up in its app's HTTP backend.

    With direct streaming, a replica Serve runs but HAProxy's configuration does not name yet
    is one HAProxy cannot pin a request to: the request goes to the fallback proxy, whose own
    router picks again. Read from HAProxy's stats page.
    """
    return len(await haproxy_servers_up(stats_url, deployment)) >= count


async def live_replicas(deployment: DeploymentName) -> dict[str, str]:
    """The deployment's live replica actors: actor id -> node id."""
    replica_class = f"ServeReplica:{deployment.app_name}:{deployment.deployment_name}"
    actors = await asyncio.to_thread(list_actors, filters=[("class_name", "=", replica_class), ("state", "=", "ALIVE")])
    return {actor.actor_id: actor.node_id for actor in actors}


_actors: dict[str, Any] = {}


async def replica_actor(actor_id: str) -> Any:
    """The Ray actor of a Serve replica, by its id."""
    if actor_id not in _actors:
        import ray

        (actor,) = await asyncio.to_thread(list_actors, filters=[("actor_id", "=", actor_id)])
        _actors[actor_id] = ray.get_actor(actor.name, namespace=actor.ray_namespace)
    return _actors[actor_id]


async def call_replica(actor_id: str, method: str, *args: Any, timeout_s: float = 30, **kwargs: Any) -> Any:
    """Call a method of the deployment's class on one replica, whatever it holds.

    Serve's replica actor takes each call with its request metadata (which method to
    run), pickled, as Serve's router sends it: this is the one place the tests build
    that internal message.
    """
    from ray.serve._private.common import RequestMetadata

    request_id = f"test-{uuid.uuid4().hex}"
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method=method)
    actor = await replica_actor(actor_id)
    return await asyncio.wait_for(actor.handle_request.remote(pickle.dumps(metadata), *args, **kwargs), timeout_s)


async def ongoing_at(actor_id: str) -> int:
    """Requests one replica is answering: Serve's own count (what its routers ask each replica)."""
    actor = await replica_actor(actor_id)
    return await asyncio.wait_for(actor.get_num_ongoing_requests.remote(), 30)


async def in_flight(deployment: DeploymentName) -> int:
    """Requests the deployment's engines hold (running or waiting), over all its live replicas."""
    counts = [await call_replica(replica, "in_flight") for replica in await live_replicas(deployment)]
    return sum(counts)


async def in_flight_reaches_zero(deployment: DeploymentName, within_s: float = 30) -> float:
    """Wait until the deployment's engines hold nothing; return how long it took (a figure to print)."""
    started = asyncio.get_running_loop().time()

    async def empty() -> bool:
        return await in_flight(deployment) == 0

    await wait_until(empty, within_s, f"{deployment}'s engines empty", every_s=0.02)
    return asyncio.get_running_loop().time() - started


def replica_engines(deployment: DeploymentName) -> dict[str, list[psutil.Process]]:
    """The vLLM engine-core processes of each live replica (the real engine's), by replica actor id.

    Blocking (it asks Ray's state API): call it through ``asyncio.to_thread``.
    """
    replica_class = f"ServeReplica:{deployment.app_name}:{deployment.deployment_name}"
    replicas = list_actors(filters=[("class_name", "=", replica_class), ("state", "=", "ALIVE")])
    return {
        replica.actor_id: [
            child
            for child in psutil.Process(replica.pid).children(recursive=True)
            if "EngineCore" in " ".join(child.cmdline())
        ]
        for replica in replicas
    }


async def death_reason(actor_id: str) -> str | None:
    """Why Ray says a (dead) actor died, e.g. ``WORKER_DIED`` or ``RAY_KILL``; None while it lives."""
    (actor,) = await asyncio.to_thread(list_actors, filters=[("actor_id", "=", actor_id)], detail=True)
    if actor.state != "DEAD":
        return None
    return (actor.death_cause or {}).get("actor_died_error_context", {}).get("reason")


async def serve_replica_id(actor_id: str) -> str:
    """Serve's id of a replica (what its log file is named by), from its actor's id."""
    (actor,) = await asyncio.to_thread(list_actors, filters=[("actor_id", "=", actor_id)])
    return actor.name.rsplit("#", 1)[-1]  # SERVE_REPLICA::<app>#<deployment>#<replica id>


def request_log_lines(
    session_dir: str, app_name: str, deployment: str = "*", replica: str = "*"
) -> dict[str, dict[str, Any]]:
    """The app's one JSON line per request, by the request's id (the client's ``X-Request-Id``; on a
    multiplexed gRPC call, whose requests share the call's id, ``<id>/<stream_id>``).

    Read from the Serve log of every replica of the app (or of one deployment's, or one
    replica's: its Serve id) in the session's log directory, as an operator would: the ingress
    writes it, or with direct streaming the model replica that answered. Blocking: call it
    through ``asyncio.to_thread``.
    """
    lines = {}
    for path in Path(session_dir, "logs", "serve").glob(f"replica_{app_name}_{deployment}_{replica}.log"):
        for line in path.read_text(errors="replace").splitlines():
            head, sep, payload = line.partition(' -- {"event":"request"')
            if sep:
                request_id = head.split()[-1]
                fields = json.loads('{"event":"request"' + payload)
                lines[request_id + (f"/{fields['stream_id']}" if "stream_id" in fields else "")] = fields
    return lines


async def autoscaling_total(deployment: DeploymentName) -> float:
    """What Serve's autoscaler reads for the deployment now: its running and queued requests, as the
    controller aggregated its replicas' reports over the look-back period (the number its default
    policy divides by ``target_ongoing_requests``). Serve's controller's own testing read."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deployment_id = DeploymentID(name=deployment.deployment_name, app_name=deployment.app_name)
    return float(await controller._get_total_num_requests_for_deployment_for_testing.remote(deployment_id))
