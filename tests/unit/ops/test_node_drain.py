"""The preStop drain's own logic: where it finds Ray, how long it waits.

tests/e2e/test_node_drain.py drains a real Ray node.
"""

from __future__ import annotations

import time

import pytest

from serve_app.ops import node_drain


class Clock:
    """Time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_wait_ends_when_the_node_has_no_serve_actor_left():
    clock, seen = Clock(), iter([["ServeReplica:glm:model"], ["ServeReplica:glm:model"], []])
    assert node_drain.wait_until_empty(lambda: next(seen), deadline=60, clock=clock, sleep=clock.sleep) == []
    assert clock.now == 2 * node_drain.POLL_S


def test_the_wait_ends_at_the_deadline_with_what_is_left():
    clock = Clock()
    left = node_drain.wait_until_empty(lambda: ["ProxyActor"], deadline=5, clock=clock, sleep=clock.sleep)
    assert left == ["ProxyActor"] and clock.now == 5


def test_a_failed_look_is_no_reason_to_stop_waiting():
    clock, outcomes = Clock(), iter([RuntimeError("dashboard unreachable"), ["ServeReplica:glm:model"], []])

    def look() -> list[str]:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert node_drain.wait_until_empty(look, deadline=60, clock=clock, sleep=clock.sleep) == []
    assert clock.now == 2 * node_drain.POLL_S


def test_when_no_look_succeeds_the_wait_lasts_the_grace_period_and_says_so():
    clock = Clock()

    def look() -> list[str]:
        raise RuntimeError("dashboard unreachable")

    assert node_drain.wait_until_empty(look, deadline=3, clock=clock, sleep=clock.sleep) is None
    assert clock.now == 3


@pytest.mark.parametrize(
    ("env", "address"),
    [
        ({"RAY_ADDRESS": "head:6379", "FQ_RAY_IP": "x", "RAY_PORT": "1"}, "head:6379"),
        ({"FQ_RAY_IP": "head.ns.svc.cluster.local", "RAY_PORT": "6379"}, "head.ns.svc.cluster.local:6379"),
        ({"FQ_RAY_IP": "only-the-host"}, "auto"),
        ({}, "auto"),
    ],
)
def test_the_gcs_address_comes_from_ray_or_from_what_kuberay_sets_in_a_worker_pod(monkeypatch, env, address):
    for name in ("RAY_ADDRESS", "FQ_RAY_IP", "RAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_drain.default_address() == address


def test_a_gcs_call_is_made_again_until_it_answers():
    clock, outcomes = Clock(), iter([TimeoutError("no answer"), TimeoutError("no answer"), "node-a"])

    def call() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert node_drain.until_answered(call, "ask", deadline=60, clock=clock, sleep=clock.sleep) == "node-a"
    assert clock.now == 2 * node_drain.RETRY_S


def test_a_gcs_that_never_answers_is_waited_for_until_the_deadline_and_no_longer():
    clock = Clock()

    def call() -> str:
        raise TimeoutError("no answer")

    assert node_drain.until_answered(call, "ask", deadline=7, clock=clock, sleep=clock.sleep) is None
    assert 7 - node_drain.RETRY_S <= clock.now <= 7


def test_without_the_gcs_the_hook_keeps_the_pod_until_its_grace_period_ends(monkeypatch, caplog):
    """The drain cannot be asked for: the hook neither fails at once (Kubernetes would then stop
    the pod and cut its streams) nor returns before the grace period's end."""
    calls = []

    def unreachable(*args: object) -> str:
        calls.append(args)
        raise TimeoutError("the GCS did not answer")

    monkeypatch.setattr(node_drain, "request_drain", unreachable)
    monkeypatch.setattr(node_drain, "RETRY_S", 0.05)
    started = time.monotonic()
    assert node_drain.main(["--grace-s", "1", "--node-id", "abc", "--address", "head:6379"]) == 0
    assert time.monotonic() - started >= 1 - 0.05 and len(calls) > 1
    assert "the GCS did not answer within the grace period" in caplog.text
