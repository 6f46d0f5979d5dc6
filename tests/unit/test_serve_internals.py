"""The Ray Serve internals the app touches exist in the installed Ray, and that Ray is the one they were read in.

An upgrade of Ray fails the first test on purpose: review each function of
``serve_app/serve_internals.py`` against the new version's source (and HAProxy's
Lua action, ``ray/serve/_private/ingress_request_router.lua.tmpl``), then move
``WRITTEN_AGAINST``. The other tests say which touch broke when a name moved.
"""

from __future__ import annotations

import inspect
from pathlib import Path

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


async def test_waiting_requests_are_routed_lowest_priority_first_then_oldest() -> None:
    from types import SimpleNamespace

    from ray.serve._private.request_router.common import PendingRequest

    def waiting(priority: object) -> PendingRequest:
        return PendingRequest(args=[SimpleNamespace(priority=priority), None], kwargs={}, metadata=None)

    class Queue(serve_internals.PriorityOrder):
        def __init__(self, requests: list[PendingRequest]) -> None:
            from collections import deque

            self._pending_requests_to_route = deque(requests)

    old, cancelled, heavy, light, later_light, odd = (waiting(p) for p in (5, 0, 7, 1, 1, "-9"))
    cancelled.future.cancel()
    queue = Queue([old, cancelled, heavy, light, later_light, odd])
    routed = [queue._get_next_pending_request_to_route() for _ in range(5)]
    assert routed == [odd, light, later_light, old, heavy]  # ("-9" is no priority: 0)
    assert queue._get_next_pending_request_to_route() is None
    no_args = PendingRequest(args=[], kwargs={}, metadata=None)
    assert serve_internals.request_priority(no_args) == 0


def test_serve_routes_waiting_requests_through_the_methods_priority_order_replaces() -> None:
    from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

    from serve_app.priority_router import PriorityOrderedRouter

    source = inspect.getsource(RequestRouter)
    assert "self._get_next_pending_request_to_route()" in source
    assert "self._fulfill_next_pending_request(" in source
    assert "self._pending_requests_to_route.append(pending_request)" in source
    mro = PriorityOrderedRouter.__mro__
    assert mro.index(serve_internals.PriorityOrder) < mro.index(FIFOMixin)  # each task routes its own request
    assert callable(RequestRouter._fulfill_next_pending_request)


def test_a_handles_queue_is_read_where_serve_counts_it() -> None:
    from ray.serve._private.router import AsyncioRouter, RouterMetricsManager

    assert "self._metrics_manager = RouterMetricsManager(" in inspect.getsource(AsyncioRouter.__init__)
    source = inspect.getsource(RouterMetricsManager)
    assert "self.num_queued_requests >= max_queued_requests" in source
    assert "self._deployment_config.max_queued_requests" in source

    class Unused:
        _router = None

    assert serve_internals.queue_state(Unused()) == serve_internals.QueueState(0, -1)
