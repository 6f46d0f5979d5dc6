"""The Ray Serve internals the app touches exist in the installed Ray, and that Ray is the one they were read in.

An upgrade of Ray fails the first test on purpose: review each function of
``serve_app/serve_internals.py`` against the new version's source (and HAProxy's
Lua action, ``ray/serve/_private/ingress_request_router.lua.tmpl``), then move
``WRITTEN_AGAINST``. The other tests say which touch broke when a name moved.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.serve import Application
from ray.serve._private import constants
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.handle import DeploymentHandle

from serve_app import serve_internals


def test_the_installed_ray_is_the_one_the_internals_were_written_against() -> None:
    assert ray.__version__ == serve_internals.WRITTEN_AGAINST, (
        f"Ray {ray.__version__} is installed; serve_app/serve_internals.py was written against "
        f"{serve_internals.WRITTEN_AGAINST}: check each of its touches, then update WRITTEN_AGAINST"
    )


def test_an_application_takes_an_ingress_request_router() -> None:
    assert callable(Application._with_ingress_request_router)
    assert "self._ingress_request_router" in inspect.getsource(Application._with_ingress_request_router)


def test_a_handle_chooses_a_replica_without_reserving_it_and_the_replica_names_its_http_server() -> None:
    from ray.serve._private.router import AsyncioRouter

    assert "_reserve" in inspect.getsource(AsyncioRouter)
    assert callable(DeploymentHandle.choose_replica)
    assert isinstance(inspect.getattr_static(RunningReplica, "backend_http_endpoint"), property)


def test_haproxys_lua_action_posts_to_the_route_path_and_reads_the_fields_the_picker_answers() -> None:
    lua = (Path(constants.__file__).parent / "ingress_request_router.lua.tmpl").read_text()
    assert f"POST {serve_internals.ROUTE_PATH} HTTP" in lua
    assert '"replica_id"' in lua
    assert f'"{serve_internals.REQUEST_HEADERS_FIELD}"' in lua
    assert constants.RAY_SERVE_INGRESS_REQUEST_ROUTER_OPT_HEADERS_FIELD == serve_internals.REQUEST_HEADERS_FIELD


def test_serve_tells_a_request_router_only_of_dispatched_requests_so_a_pick_is_told_on_the_routers_loop() -> None:
    import dataclasses

    from ray.serve._private.request_router.replica_wrapper import ReplicaSelection
    from ray.serve._private.router import AsyncioRouter, CurrentLoopRouter, SingletonThreadRouter

    assert "on_request_routed" not in inspect.getsource(AsyncioRouter.choose_replica)  # why pick_replica tells
    assert "on_request_routed" in inspect.getsource(AsyncioRouter)  # (it does, for dispatched requests)
    assert "self._router: Optional[Router]" in inspect.getsource(DeploymentHandle.__mro__[1].__init__)
    for wrapper in (CurrentLoopRouter, SingletonThreadRouter):
        assert "self._asyncio_router = AsyncioRouter(" in inspect.getsource(wrapper.__init__)
    assert "self._event_loop = event_loop" in inspect.getsource(AsyncioRouter.__init__)
    assert isinstance(inspect.getattr_static(AsyncioRouter, "request_router"), property)
    assert "_request_metadata" in {field.name for field in dataclasses.fields(ReplicaSelection)}


def test_serve_refuses_an_ingress_request_router_without_the_haproxy_flag_the_app_reads() -> None:
    """build_app leaves the picker out when this flag is off, as Serve would refuse it then."""
    from ray.serve._private import build_app

    source = inspect.getsource(build_app.build_app)
    assert "ingress_request_router is not None and not RAY_SERVE_ENABLE_HA_PROXY" in source
    assert serve_internals.haproxy_enabled() is constants.RAY_SERVE_ENABLE_HA_PROXY


def test_ray_exports_metrics_at_the_interval_the_kept_gauges_read() -> None:
    assert serve_internals.metrics_export_interval_s() == max(ray._config.metrics_report_interval_ms(), 1000) / 1000


def test_replica_states_ask_the_controller_for_one_deployments_details() -> None:
    """replica_states calls the controller's ``get_deployment_details(app_name, deployment_name)``,
    which answers that deployment's ``DeploymentDetails`` (its replicas' states among them) or
    raises KeyError for a deployment it does not know."""
    from ray.serve._private.controller import ServeController
    from ray.serve.schema import DeploymentDetails, ReplicaDetails

    method = ServeController.get_deployment_details
    assert list(inspect.signature(method).parameters) == ["self", "app_name", "deployment_name"]
    assert "list_deployment_details(app_name)[" in inspect.getsource(method)
    assert "replicas" in DeploymentDetails.model_fields and "state" in ReplicaDetails.model_fields


def test_serves_direct_ingress_reads_the_two_client_headers_the_replicas_ignore_where_they_are_replaced() -> None:
    """``ignore_client_control_headers`` replaces the two names ``Replica._direct_ingress_asgi`` calls."""
    from ray.serve._private import http_util, replica

    source = inspect.getsource(replica.Replica._direct_ingress_asgi)
    assert "parse_disconnect_disabled_header(headers)" in source
    assert "self._parse_request_timeout(headers)" in source
    assert "parse_request_timeout_header(headers, http_options.request_timeout_s)" in inspect.getsource(
        replica.Replica._parse_request_timeout
    )
    assert replica.parse_disconnect_disabled_header is http_util.parse_disconnect_disabled_header
    assert replica.parse_request_timeout_header is http_util.parse_request_timeout_header


def test_a_replicas_custom_autoscaling_metrics_replace_serves_own_count_of_its_running_requests() -> None:
    """The model replica reports its answers under Serve's own key (AUTOSCALING_COUNT): Serve merges
    a replica's ``record_autoscaling_stats`` over its count of ongoing requests, collected from the
    replicas of a direct-ingress deployment, and its default policy reads that key."""
    from ray.serve._private import autoscaling_state
    from ray.serve._private.common import RUNNING_REQUESTS_KEY
    from ray.serve._private.replica import ReplicaMetricsManager

    assert serve_internals.AUTOSCALING_COUNT == RUNNING_REQUESTS_KEY
    merge = inspect.getsource(ReplicaMetricsManager._add_autoscaling_metrics_point_async)
    assert merge.index("RUNNING_REQUESTS_KEY: self._num_ongoing_requests") < merge.index("update(custom_metrics)")
    assert "self._is_direct_ingress and self._autoscaling_config" in inspect.getsource(
        ReplicaMetricsManager.should_collect_ongoing_requests
    )
    assert "RUNNING_REQUESTS_KEY in replica_metric_report.metrics" in inspect.getsource(autoscaling_state)


def test_serves_direct_ingress_entry_is_the_method_answer_probes_first_wraps() -> None:
    """``answer_probes_first`` wraps ``Replica._direct_ingress_asgi(self, scope, receive, send)``, the
    ASGI app each replica's own HTTP server is started with once the replica is built, and reads the
    route as Serve does."""
    from ray.serve._private import replica

    method = replica.Replica._direct_ingress_asgi
    assert list(inspect.signature(method).parameters) == ["self", "scope", "receive", "send"]
    assert 'route = scope.get("path", "")[len(root_path) :]' in inspect.getsource(method)
    start = inspect.getsource(replica.Replica._maybe_start_direct_ingress_servers)
    assert "self._direct_ingress_asgi," in start


def test_a_probe_is_answered_first_and_every_other_request_goes_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET of a probe's path is answered by the probe alone; a POST there, a GET elsewhere and a
    browser's GET (an ``Origin`` header, for CORS) reach Serve's own entry."""
    from ray.serve._private import replica

    reached: list[str] = []

    async def serve_entry(self: object, scope: dict, receive: object, send: object) -> None:
        reached.append(f"{scope['method']} {scope['path']}")

    monkeypatch.setattr(replica.Replica, "_direct_ingress_asgi", serve_entry)
    answered: list[str] = []

    def probe() -> Any:
        async def respond(scope: dict, receive: object, send: object) -> None:
            answered.append(f"{scope['method']} {scope['path']}")

        return respond

    serve_internals.answer_probes_first({"/health": probe})

    def request(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None, prefix: str = "/") -> None:
        scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers or []}
        replica_of_app = SimpleNamespace(_route_prefix=prefix)
        asyncio.run(replica.Replica._direct_ingress_asgi(replica_of_app, scope, None, None))

    request("GET", "/health")
    request("GET", "/app/health", prefix="/app")
    request("POST", "/health")
    request("GET", "/v1/models")
    request("GET", "/health", [(b"origin", b"https://example.com")])
    request("GET", "/health", prefix="/app")
    request("GET", "/apphealth", prefix="/app")
    assert answered == ["GET /health", "GET /app/health"]
    assert reached == ["POST /health", "GET /v1/models", "GET /health", "GET /health", "GET /apphealth"]
