"""PrefixAffinityRouter told of a pick nobody dispatches (direct streaming's ReplicaPicker).

Serve reports a request to its router (``on_request_routed``) only when it dispatches
it; the picker only names a replica, and HAProxy sends the request. These tests build
the real router (no replicas, no Ray) and tell it of picks as
:func:`serve_app.serve_internals.pick_replica` does.
"""

from __future__ import annotations

import time

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from serve_app.prefix_routing.router import PrefixAffinityRouter
from serve_app.prefix_routing.table import Choice, Decision, RoutingKey
from serve_app.serve_internals import PickListener

DEPLOYMENT = DeploymentID(name="model-glm-4-9b-chat", app_name="glm")
KEY = RoutingKey(blocks=(11, 12, 13), home=b"opening", opening_blocks=1, whole=b"prompt")


@pytest.fixture
def router() -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model="glm-4-9b-chat")
    return router


def replica(unique_id: str) -> ReplicaID:
    return ReplicaID(unique_id, DEPLOYMENT)


def test_the_router_is_one_the_picker_tells(router: PrefixAffinityRouter) -> None:
    assert isinstance(router, PickListener)


def test_a_picked_replica_learns_the_prompt(router: PrefixAffinityRouter) -> None:
    router._routing["picked"] = (KEY, Choice(None, Decision.HOME), time.monotonic())
    router.on_replica_picked("picked", replica("a"))
    assert router._table.longest_match(KEY.blocks, ["a", "b"]) == (len(KEY.blocks), ("a",))


def test_a_pick_counts_as_its_replicas_load_until_probes_can_see_it(router: PrefixAffinityRouter) -> None:
    """Serve's queue-length cache in the picker never sees the request sent: the pick stands in."""
    router._routing["picked"] = (KEY, Choice(None, Decision.BY_LOAD), time.monotonic())
    router.on_replica_picked("picked", replica("a"))
    loads = {"a": 0, "b": 0}
    running: set[str] = set()
    router._count_choices_not_yet_sent("next", KEY, loads, running)
    assert loads == {"a": 1, "b": 0}
    assert running == {"a"}  # the same prompt: a copy of it may spread


def test_a_pick_of_another_replica_than_preferred_is_a_fallback(router: PrefixAffinityRouter) -> None:
    router._routing["picked"] = (KEY, Choice("a", Decision.AFFINITY, 3), time.monotonic())
    router.on_replica_picked("picked", replica("b"))
    assert router._routing["picked"][1] == Choice("b", Decision.FALLBACK, 3)


def test_a_pick_of_a_request_with_no_prompt_read_changes_nothing(router: PrefixAffinityRouter) -> None:
    router.on_replica_picked("routed by load", replica("a"))
    assert len(router._table) == 0
    assert "routed by load" not in router._routing
