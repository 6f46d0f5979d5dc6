"""Readiness for GET /health: Serve's status read in the background, one controller call at a time."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from serve_app.front_door.core.readiness import Readiness, ReadinessWatch, running_models
from tests.waiting import wait_until

DEPLOYMENTS = {"glm-4-9b-chat": "model-glm-4-9b-chat", "second": "model-second"}


def test_model_with_a_running_replica_is_up_and_one_without_is_down():
    states = {"model-glm-4-9b-chat": {"RUNNING": 1, "STARTING": 1}, "model-second": {"STARTING": 1}}
    assert running_models(states, DEPLOYMENTS) == {"glm-4-9b-chat": True, "second": False}


def test_missing_deployment_or_application_is_down():
    assert running_models({}, DEPLOYMENTS) == {"glm-4-9b-chat": False, "second": False}


RUNNING_STATUS = {"model-glm-4-9b-chat": {"RUNNING": 1}, "model-second": {"RUNNING": 2}}


class Controller:
    """Stands in for ``serve_internals.replica_states``: answers at once, or stalls until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.stalled = threading.Event()
        self.released = threading.Event()
        self.released.set()
        self.fail = False

    def __call__(self):
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if not self.released.is_set():
                self.stalled.set()
                self.released.wait(10)
            if self.fail:
                raise ConnectionError("controller unreachable")
            return RUNNING_STATUS
        finally:
            self.in_flight -= 1


@pytest.fixture
def watches():
    """Watches made by a test, stopped after it."""
    made: list[ReadinessWatch] = []
    yield made
    for watch in made:
        watch.stop()


class Engine:
    """Stands in for this replica's engine watch: serving until it fails."""

    def __init__(self) -> None:
        self.failed = False

    def serves(self) -> bool:
        return not self.failed


@pytest.fixture
def watch_of(watches):
    def make(controller: Controller, max_age_s: float = 30.0, engine: Engine | None = None) -> ReadinessWatch:
        engine = engine or Engine()
        watch = ReadinessWatch(
            controller, DEPLOYMENTS, max_age_s=max_age_s, engine_serves=engine.serves, refresh_s=0.01
        )
        watches.append(watch)
        return watch

    return make


async def test_not_ready_until_the_controller_first_answers(watch_of):
    controller = Controller()
    controller.released.clear()
    watch = watch_of(controller)
    assert not watch.readiness().ready  # before the first answer
    watch.start()
    await asyncio.to_thread(controller.stalled.wait, 5)
    readiness = watch.readiness()
    assert not readiness.ready and readiness.age_s is None and "not known yet" in readiness.problem()
    controller.released.set()
    await wait_until(lambda: watch.readiness().ready, 5, "the watch ready", every_s=0.01)
    assert watch.readiness().models == {"glm-4-9b-chat": True, "second": True}


async def test_a_stalled_controller_keeps_the_last_answer_with_its_age_and_one_call_in_flight(watch_of):
    controller = Controller()
    engine = Engine()
    watch = watch_of(controller, max_age_s=0.5, engine=engine)
    watch.start()
    await wait_until(lambda: watch.readiness().ready, 5, "the watch ready", every_s=0.01)
    controller.released.clear()
    await asyncio.to_thread(controller.stalled.wait, 5)
    calls = controller.calls
    for _ in range(1000):  # a flood of probes: answered from memory, no call each
        assert watch.readiness().ready
    await wait_until(lambda: watch.readiness().stale, 5, "the answer stale", every_s=0.01)
    assert controller.calls == calls and controller.most_in_flight == 1  # all that time: no call more
    # Past max_age_s this replica answers for itself: ready while its engine serves...
    readiness = watch.readiness()
    assert readiness.ready and not readiness.controller_reachable
    assert readiness.models == {"glm-4-9b-chat": True, "second": True}
    # ...and not once its engine failed.
    engine.failed = True
    readiness = watch.readiness()
    assert not readiness.ready and readiness.models == {"glm-4-9b-chat": False, "second": False}
    assert "has not answered for" in readiness.problem() and "engine has failed" in readiness.problem()
    controller.released.set()
    await wait_until(lambda: watch.readiness().controller_reachable, 5, "the controller's answer fresh", every_s=0.01)
    assert watch.readiness().ready  # Serve's word again: the deployments have running replicas


async def test_while_the_controller_answers_its_word_counts_not_the_engine(watch_of):
    """Serve's view is the cluster's: a replica whose own engine failed still reports the models
    that have running replicas elsewhere (it passes its requests on to them)."""
    engine = Engine()
    engine.failed = True
    watch = watch_of(Controller(), engine=engine)
    watch.start()
    await wait_until(lambda: watch.readiness().ready, 5, "the watch ready", every_s=0.01)


async def test_a_failing_controller_is_logged_once_and_ages_out(caplog, watch_of):
    controller = Controller()
    controller.fail = True
    watch = watch_of(controller, max_age_s=0.2)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        watch.start()
        await wait_until(lambda: controller.calls >= 5, 5, "5 calls to the controller", every_s=0.01)
    assert len([r for r in caplog.records if "reading Serve's status" in r.getMessage()]) == 1
    assert not watch.readiness().ready  # never answered: nothing known yet


def test_a_model_without_a_running_replica_is_named():
    readiness = Readiness({"glm-4-9b-chat": True, "second": False}, age_s=1.0, max_age_s=30)
    assert not readiness.ready and readiness.problem() == "no healthy replica for: second"
