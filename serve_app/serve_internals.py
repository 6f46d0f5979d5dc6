"""Every place the app reaches into Ray Serve past its public API, in one module.

Direct streaming rests on Serve's *ingress request router*: an application's
ingress deployment is given a peer deployment that Serve's HAProxy asks, for each
request, which replica of the ingress should answer it; HAProxy then forwards the
client's connection to that replica's own HTTP port. Ray Serve LLM's direct
streaming is built on it, and Ray marks it internal and unstable. Each touch is a
function here, named for what it does, so a Ray upgrade has one module to review;
``tests/unit/test_serve_internals.py`` fails on any Ray version other than
:data:`WRITTEN_AGAINST` and checks that every name used here still exists.

Runs in the application's build, each model replica and each ReplicaPicker replica (each function is
called where its caller runs).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ray.serve import Application
from ray.serve import context as serve_context
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Receive, Scope, Send

# Serve's request-router API, which a custom request router subclasses and reads
# (serve_app.routing.prefix_router's PrefixAffinityRouter); Ray keeps it under _private.
__all__ = [
    "DeploymentID",
    "LocalityMixin",
    "MultiplexMixin",
    "PendingRequest",
    "PowerOfTwoChoicesRequestRouter",
    "ReplicaID",
    "RequestRouter",
    "RunningReplica",
]

WRITTEN_AGAINST = "2.60.0"

# What the router answers HAProxy's Lua action (ray/serve/_private/ingress_request_router.lua.tmpl):
# a flat JSON object whose "replica_id" names the replica; headers under this field are set
# on the request HAProxy forwards.
ROUTE_PATH = "/internal/route"
# Set on that request when HAProxy's buffer cut the body (its value: "<sent>/<whole length>").
BODY_TRUNCATED_HEADER = "x-body-truncated"
REQUEST_HEADERS_FIELD = "request_headers"
# Ray's request router that sends every call with one session id to the same replica (consistent
# hashing over the running replicas; experimental in Ray 2.60): the RateLimiter's, keyed by API key.
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"
# The metric a replica reports to Serve's autoscaling as its running requests (Serve's own key,
# ray.serve._private.common.RUNNING_REQUESTS_KEY). A replica's custom autoscaling metrics
# (``record_autoscaling_stats``) are merged over Serve's own count of ongoing requests
# (ray/serve/_private/replica.py, ``_add_autoscaling_metrics_point_async``), so a model replica
# that reports this key is counted by its answers, whatever its calls; Serve's default
# queue-length policy then reads it as it reads its own count (docs/architecture.md, record 27).
AUTOSCALING_COUNT = "running_requests"
# A routing-only keyword (never sent to a replica): the replica the ReplicaPicker named for a
# request another replica received (:func:`picked_replica`).
PICKED_REPLICA = "_picked_replica"


@dataclass(frozen=True)
class ReplicaEndpoint:
    """Where HAProxy sends a request: a replica's own HTTP server, and the id HAProxy knows it by."""

    host: str
    port: int
    replica_id: str


def with_ingress_request_router(ingress: Application, router: Application) -> Application:
    """``ingress`` with ``router`` as its ingress request router (Serve needs HAProxy on for it)."""
    return ingress._with_ingress_request_router(router)


def haproxy_enabled() -> bool:
    """Whether Serve runs HAProxy in this cluster (``RAY_SERVE_ENABLE_HA_PROXY`` where Ray started,
    which the process building the application inherits): Serve refuses an ingress request
    router without it."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

    return RAY_SERVE_ENABLE_HA_PROXY


def haproxy_deregistration_s() -> float:
    """How long a replica HAProxy sends requests to must keep answering once Serve stops it:
    Serve's own minimum drain of a direct-ingress replica (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``,
    30 s by default), which Serve applies to the application's ingress replicas only. Read where
    the application is built, which runs with the application's environment."""
    from ray.serve._private.constants import RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S

    return RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S


def replica_states(app_name: str, deployment_names: Iterable[str]) -> dict[str, dict[str, int]]:
    """Each named deployment of the application: its replicas counted by state (``RUNNING``, ...), as
    Serve's controller reports them; a deployment it does not know has none. Blocking (one
    controller call per deployment).

    Asked of the controller one deployment at a time (its ``get_deployment_details``), not as
    ``serve.status()`` asks: that builds the details of every application, with HAProxy's target
    groups, 18 ms of the controller's CPU a call against 2 ms with the test suite's dozen
    applications, while every model replica asks once a second (a fifth of the controller's core
    with a dozen replicas, growing with applications times replicas); and its parse rebuilds every
    deployment's request-router config, a tenth of a core in each replica.
    """
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # (Serve not started)
        return {}
    states: dict[str, dict[str, int]] = {}
    for name in deployment_names:
        try:
            details = ray.get(client._controller.get_deployment_details.remote(app_name, name))
        except KeyError:  # (the controller's KeyError, re-raised here: no such deployment, or not yet)
            states[name] = {}
            continue
        counts: dict[str, int] = {}
        for replica in details.replicas:
            state = str(getattr(replica.state, "value", replica.state))
            counts[state] = counts.get(state, 0) + 1
        states[name] = counts
    return states


def metrics_export_interval_s() -> float:
    """How often Ray exports a process's metrics (its ``metrics_report_interval_ms``, read as its
    metric recorder reads it: at least 1 s); 10 s by Ray's default."""
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000


@runtime_checkable
class PickListener(Protocol):
    """A request router that wants to know the replica picked for a request nobody dispatches
    (:meth:`serve_app.routing.prefix_router.PrefixAffinityRouter.on_replica_picked`)."""

    def on_replica_picked(self, internal_request_id: str, replica_id: Any) -> None: ...


async def pick_replica(handle: DeploymentHandle, *routing_args: Any) -> ReplicaEndpoint:
    """Run the deployment's request router for a request and name the replica it picks.

    Nothing is sent to the replica: HAProxy sends the request itself. No slot is
    reserved on the replica either (``_reserve=False``, as Ray Serve LLM's router
    does): the request reaches the replica over HTTP, where Serve counts it. Serve
    tells a request router of a request only when it dispatches one
    (``on_request_routed``), so a router that learns from its picks is told here.
    """
    replica = await _pick(handle, *routing_args)
    endpoint = replica.backend_http_endpoint
    if endpoint is None:
        raise RuntimeError(f"replica {replica.replica_id} has no HTTP server of its own")
    host, port = endpoint
    return ReplicaEndpoint(host, port, replica.replica_id.to_full_id_str())


def any_replica(handle: DeploymentHandle) -> ReplicaEndpoint | None:
    """A replica of the deployment at random from the list its request router holds, with no
    routing pass (no queue-length probe, nothing recorded): for a request any replica answers
    alike. None until the handle's router holds a replica with an HTTP server of its own."""
    router = handle._router
    request_router = router._asyncio_router.request_router if router is not None else None
    if request_router is None:
        return None
    endpoints = [
        (replica.backend_http_endpoint, replica.replica_id)
        for replica in list(request_router.curr_replicas.values())
        if replica.backend_http_endpoint is not None
    ]
    if not endpoints:
        return None
    (host, port), replica_id = random.choice(endpoints)
    return ReplicaEndpoint(host, port, replica_id.to_full_id_str())


async def pick_replica_id(handle: DeploymentHandle, *routing_args: Any) -> str:
    """The full id of the replica the deployment's request router picks for a request (as
    :func:`pick_replica`, for a replica that sends the request on itself: no HTTP port needed)."""
    return (await _pick(handle, *routing_args)).replica_id.to_full_id_str()


async def _pick(handle: DeploymentHandle, *routing_args: Any) -> Any:
    async with handle.choose_replica(*routing_args, _reserve=False) as selection:
        replica = selection._replica
        _tell_router(handle, selection._request_metadata.internal_request_id, replica.replica_id)
        return replica


def _tell_router(handle: DeploymentHandle, internal_request_id: str, replica_id: Any) -> None:
    """Tell the handle's request router, on its own event loop, which replica it picked."""
    router = handle._router._asyncio_router  # (set by choose_replica)
    # (An attribute lookup, not isinstance against the runtime-checkable Protocol: that walks
    # the Protocol's members on every call, a few percent of the picker's loop.)
    listen = getattr(router.request_router, "on_replica_picked", None)
    if listen is None:
        return
    if router._event_loop is asyncio.get_running_loop():
        listen(internal_request_id, replica_id)
    else:  # Serve runs the router on a loop of its own (not in throughput mode)
        router._event_loop.call_soon_threadsafe(listen, internal_request_id, replica_id)


@asynccontextmanager
async def picked_replica(handle: DeploymentHandle, replica_id: str, *routing_args: Any) -> AsyncIterator[Any]:
    """Serve's ``ReplicaSelection`` of the replica ``replica_id`` (a full replica id, as
    :func:`pick_replica` names it) of ``handle``'s deployment, a slot held on it; another
    replica only if that one is full or gone. The deployment's request router honours the pick
    (:mod:`serve_app.routing.prefix_router`).

    ``handle.dispatch(selection, ...)`` sends the request there (await the answer's first item
    inside the block, as Serve requires); leaving the block without it releases the slot.
    ``choose_replica`` and ``dispatch`` are Serve's public API.
    """
    async with handle.choose_replica(*routing_args, **{PICKED_REPLICA: replica_id}) as selection:
        yield selection


def start_at_zero(counter: Any, tags: dict[str, str]) -> None:
    """Export ``counter`` with ``tags`` at 0 before its first event.

    A series that first appears at 1 hides that event from ``rate`` and
    ``increase`` (Prometheus needs a sample before it), and a panel or alert on an
    event that has not happened yet reads "no data" instead of 0. Ray's ``inc``
    refuses 0, so this records through the method ``inc`` itself calls (the one
    place the app reaches into Ray's metrics), after adding Serve's replica tags
    as Serve's ``inc`` does.
    """
    from ray.serve.metrics import _add_serve_context_tag_values

    tags = dict(tags)
    _add_serve_context_tag_values(counter._tag_keys, tags)
    counter._record(0, tags)


def own_replica_id() -> ReplicaID | None:
    """The id of the Serve replica this process is, or None (a proxy, a driver)."""
    context = serve_context._get_internal_replica_context()
    return None if context is None else context.replica_id


def client_control_headers() -> tuple[str, ...]:
    """The request headers from which Serve's replicas take settings of their own: a client's are
    ignored (:func:`ignore_client_control_headers`), and k8s/gateway removes them at the edge."""
    from ray.serve._private.constants import (
        SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER,
        SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER,
    )

    return (SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER, SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER)


def ignore_client_control_headers() -> None:
    """This process's Serve replica no longer takes two of its settings from a client's headers.

    Serve's direct ingress reads ``x-request-disconnect-disabled: ?1`` (keep running after the
    client left: a unary answer then held its lease and slot for up to the answer's limit) and
    ``x-request-timeout-seconds`` (lengthen, or with 0 remove, Serve's limit on the request) from
    the request itself, and HAProxy passes any client's on. The configured behaviour stands for
    every request. Called by each model replica as it starts, before it serves.
    """
    from ray.serve._private import replica

    replica.parse_disconnect_disabled_header = lambda headers: False
    replica.parse_request_timeout_header = lambda headers, default_timeout_s: default_timeout_s


# What a probe's path answers: a response, made from what the replica already holds (no await).
ProbeAnswer = Callable[[], ASGIApp]


def answer_probes_first(probes: Mapping[str, ProbeAnswer]) -> None:
    """This process's Serve replica answers a ``GET`` of each of ``probes``' paths as soon as its own
    HTTP server has read it, as Serve answers its ``/-/healthz`` there.

    Serve's direct ingress (``Replica._direct_ingress_asgi``) otherwise gives every request its
    record, a slot, a task that watches the client and a task that runs the application, which
    waits for it: each a turn of the replica's event loop, and under a burst each turn waits
    behind the requests ready before it. A probe answered first takes one turn. It is then in
    neither Serve's request metrics nor its access log (HAProxy's metrics count it); a request
    with an ``Origin`` header (a browser's, for CORS) goes the usual way. Called by each model
    replica as it starts, before its server does; a later call replaces the paths.
    """
    from ray.serve._private import replica

    global _probes
    _probes = dict(probes)
    if getattr(replica.Replica._direct_ingress_asgi, "answers_probes_first", False):
        return
    serve_asgi = replica.Replica._direct_ingress_asgi

    async def direct_ingress_asgi(self: Any, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET":
            answer = _probes.get(_app_path(scope, self._route_prefix))
            if answer is not None and not any(name == b"origin" for name, _ in scope.get("headers", ())):
                await answer()(scope, receive, send)
                return
        await serve_asgi(self, scope, receive, send)

    direct_ingress_asgi.answers_probes_first = True  # type: ignore[attr-defined]
    replica.Replica._direct_ingress_asgi = direct_ingress_asgi


_probes: dict[str, ProbeAnswer] = {}


def _app_path(scope: Scope, route_prefix: str | None) -> str:
    """The request's path below the application's route prefix, as Serve's direct ingress reads
    it (the server's ``root_path``, then the prefix); empty outside the prefix."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    path = path[len(root) :]
    if not route_prefix or route_prefix == "/":
        return path
    if path != route_prefix and not path.startswith(route_prefix + "/"):
        return ""
    return path[len(route_prefix) :]
