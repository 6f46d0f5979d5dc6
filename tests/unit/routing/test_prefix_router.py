"""PrefixAffinityRouter told of a pick nobody dispatches (direct streaming's ReplicaPicker).

Serve reports a request to its router (``on_request_routed``) only when it dispatches
it; the picker only names a replica, and HAProxy sends the request. These tests build
the real router (no replicas, no Ray) and tell it of picks as
:func:`serve_app.serve_internals.pick_replica` does.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from serve_app.routing.prefix_router import CHOSEN_NOT_SENT_S, PICK_DELIVERY_S, PrefixAffinityRouter
from serve_app.routing.prefix_table import Choice, Decision, RoutingKey
from serve_app.serve_internals import PICKED_REPLICA, PickListener

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
    router._routing["picked"] = (KEY, Choice(None, Decision.HOME), time.monotonic() + CHOSEN_NOT_SENT_S)
    router.on_replica_picked("picked", replica("a"))
    assert router._table.longest_match(KEY.blocks, ["a", "b"]) == (len(KEY.blocks), ("a",))


def test_a_pick_counts_as_its_replicas_load_until_the_replica_has_it(router: PrefixAffinityRouter) -> None:
    """Serve's queue-length cache in the picker never sees the request sent: the pick stands in."""
    router._routing["picked"] = (KEY, Choice(None, Decision.BY_LOAD), time.monotonic() + CHOSEN_NOT_SENT_S)
    router.on_replica_picked("picked", replica("a"))
    loads = {"a": 0, "b": 0}
    running: set[str] = set()
    router._count_choices_not_yet_sent("next", KEY, loads, running)
    assert loads == {"a": 1, "b": 0}
    assert running == {"a"}  # the same prompt: a copy of it may spread


def test_a_pick_stops_counting_once_the_replica_has_it(router: PrefixAffinityRouter) -> None:
    """With direct streaming no end is reported: a pick counted past its delivery would count a
    request long finished, and a replica serving many short requests would look far busier
    than it is (its conversations' later turns then left it, losing their cached history)."""
    router._routing["picked"] = (KEY, Choice(None, Decision.BY_LOAD), time.monotonic() + CHOSEN_NOT_SENT_S)
    router.on_replica_picked("picked", replica("a"))
    assert "picked" not in router._routing  # (nothing more will be told of it)
    ((_, _, counted_until),) = router._recent_picks
    assert counted_until <= time.monotonic() + PICK_DELIVERY_S
    router._recent_picks[0] = ("a", KEY.whole, time.monotonic() - 0.001)  # (as PICK_DELIVERY_S later)
    loads = {"a": 0}
    router._count_choices_not_yet_sent("next", KEY, loads, set())
    assert loads == {"a": 0}
    assert not router._recent_picks


async def test_a_load_known_but_aging_is_probed_again_without_holding_the_request(
    router: PrefixAffinityRouter,
) -> None:
    a = SimpleNamespace(replica_id=replica("a"))
    router._replica_queue_len_cache.update(a.replica_id, 5)  # in Serve's cache, but never probed here
    probed = asyncio.Event()
    answer = asyncio.Event()

    async def probe_queue_lens(replicas: list[Any], backoff_index: int) -> list[tuple[Any, int]]:
        probed.set()
        await answer.wait()
        router._replica_queue_len_cache.update(a.replica_id, 2)
        return [(a, 2)]

    router._probe_queue_lens = probe_queue_lens
    assert await router._loads([a]) == {"a": 5}  # the load known, at once
    await probed.wait()  # (the refresh runs in the background)
    answer.set()
    await router._probes[a.replica_id]
    assert await router._loads([a]) == {"a": 2}  # fresh now: no probe started
    assert router._probes[a.replica_id].done()


def test_a_pick_of_another_replica_than_preferred_is_a_fallback(router: PrefixAffinityRouter) -> None:
    decisions: list[str] = []
    router._metrics = SimpleNamespace(routed=lambda decision, table_size: decisions.append(decision))  # type: ignore[assignment]
    router._routing["picked"] = (KEY, Choice("a", Decision.AFFINITY, 3), time.monotonic() + CHOSEN_NOT_SENT_S)
    router.on_replica_picked("picked", replica("b"))
    assert decisions == ["fallback"]


def test_a_pick_of_a_request_with_no_prompt_read_changes_nothing(router: PrefixAffinityRouter) -> None:
    router.on_replica_picked("routed by load", replica("a"))
    assert len(router._table) == 0
    assert "routed by load" not in router._routing


async def test_a_request_that_needs_a_replica_no_probe_asks_probes_it_while_another_replicas_probe_runs(
    router: PrefixAffinityRouter,
) -> None:
    """Requests that arrive together share each replica's probe, but never wait on another
    replica's probe alone: a replica left unprobed would be no candidate to prefer, and a
    conversation's next turn would lose the replica holding its history."""
    probes_started: asyncio.Queue[list[str]] = asyncio.Queue()
    answer = asyncio.Event()

    async def probe_queue_lens(replicas: list[Any], backoff_index: int) -> list[tuple[Any, int]]:  # answered later
        probes_started.put_nowait([r.replica_id.unique_id for r in replicas])
        await answer.wait()
        for r in replicas:
            router._replica_queue_len_cache.update(r.replica_id, 3)
        return [(r, 3) for r in replicas]

    router._probe_queue_lens = probe_queue_lens
    a, b = SimpleNamespace(replica_id=replica("a")), SimpleNamespace(replica_id=replica("b"))
    first = asyncio.ensure_future(router._loads([a]))
    assert await probes_started.get() == ["a"]  # the first request's probe of a, under way
    second = asyncio.ensure_future(router._loads([a, b]))
    # b by the request that needed it, a's probe shared (bounded: unprobed, b would never start)
    assert await asyncio.wait_for(probes_started.get(), 10) == ["b"]
    answer.set()
    assert await first == {"a": 3}
    assert await second == {"a": 3, "b": 3}
    assert probes_started.empty()  # a probed once


async def test_with_nothing_to_prefer_the_less_busy_of_the_two_candidates_comes_first(
    router: PrefixAffinityRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Direct streaming's picker takes the first replica of the first rank as it is (Serve compares
    a rank's loads only when it dispatches): a request load decides goes to the less busy one."""
    a, b = SimpleNamespace(replica_id=replica("a")), SimpleNamespace(replica_id=replica("b"))
    router._table.record(KEY.blocks, "a")  # a holds the prompt, but runs far more than b
    router._replica_queue_len_cache.update(a.replica_id, 30)
    router._replica_queue_len_cache.update(b.replica_id, 2)

    async def serves_random_pair(self: Any, candidate_replicas: list[Any], pending_request: Any = None) -> Any:
        return [[a, b]]  # Serve's two random candidates, in the order it drew them

    async def probe_queue_lens(replicas: list[Any], backoff_index: int) -> list[tuple[Any, int]]:
        return [(r, router._replica_queue_len_cache.get(r.replica_id)) for r in replicas]  # (no change)

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", serves_random_pair)
    router._probe_queue_lens = probe_queue_lens
    monkeypatch.setattr(router, "_key", lambda pending_request: KEY)
    pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="r"), kwargs={})
    ranks = await router.choose_replicas([a, b], pending)
    assert router._routing["r"][1] == Choice(None, Decision.FALLBACK, len(KEY.blocks))  # load decides
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b", "a"]]


async def test_a_model_replica_passing_on_requests_never_routes_them_to_itself_and_honours_a_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With direct streaming a replica whose engine died passes requests on through its own
    deployment's handle; sent back to itself they would only be refused and sent again (and the
    prompt recorded there would draw each retry back). A request the ReplicaPicker named another
    replica for (a bare `serve run`) goes there."""
    context = SimpleNamespace(  # what Serve's replica context says of replica a (and its metrics read)
        replica_id=replica("a"), app_name=DEPLOYMENT.app_name, deployment=DEPLOYMENT.name, replica_tag="a"
    )
    monkeypatch.setattr("ray.serve.context._get_internal_replica_context", lambda: context)
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model="glm-4-9b-chat")
    a, b = SimpleNamespace(replica_id=replica("a")), SimpleNamespace(replica_id=replica("b"))
    router._table.record(KEY.blocks, "a")  # the prompt went to a before its engine died
    for r in (a, b):
        router._replica_queue_len_cache.update(r.replica_id, 0)

    async def serves_random_pair(self: Any, candidate_replicas: list[Any], pending_request: Any = None) -> Any:
        return [[a, b]]

    async def probe_queue_lens(replicas: list[Any], backoff_index: int) -> list[tuple[Any, int]]:
        return [(r, 0) for r in replicas]

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", serves_random_pair)
    router._probe_queue_lens = probe_queue_lens
    monkeypatch.setattr(router, "_key", lambda pending_request: KEY)
    pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="r"), kwargs={})
    ranks = await router.choose_replicas([a, b], pending)
    assert ranks and all(r.replica_id.unique_id == "b" for rank in ranks for r in rank), ranks

    async def only_itself(self: Any, candidate_replicas: list[Any], pending_request: Any = None) -> Any:
        return [[a]]

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", only_itself)
    assert await router.choose_replicas([a], pending) == []  # none other yet: Serve waits for one

    # Named by the ReplicaPicker (a bare `serve run`): that replica first, whatever it holds.
    c = SimpleNamespace(replica_id=replica("c"))
    router._replica_queue_len_cache.update(c.replica_id, 0)

    async def serves_b_and_c(self: Any, candidate_replicas: list[Any], pending_request: Any = None) -> Any:
        return [[b, c]]

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", serves_b_and_c)
    picked = SimpleNamespace(
        metadata=SimpleNamespace(internal_request_id="s"), kwargs={PICKED_REPLICA: c.replica_id.to_full_id_str()}
    )
    ranks = await router.choose_replicas([a, b, c], picked)
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["c"], ["b", "c"]]
    assert "s" not in router._routing  # nothing learnt: the picker has


def pending(request_id: str, request: Any) -> Any:
    """What the router reads of a request Serve asks it to route: its id, method and arguments."""
    metadata = SimpleNamespace(internal_request_id=request_id, call_method="chat")
    return SimpleNamespace(metadata=metadata, args=[request])


def test_a_prompt_is_keyed_by_its_cache_salt_and_a_body_s_unusable_one_is_ignored(
    router: PrefixAffinityRouter,
) -> None:
    """As the engine caches it: the same prompt under two API keys' salts shares no block, no home."""

    def chat(salt: Any) -> SimpleNamespace:
        messages = [{"role": "user", "content": "the same question, asked at length " * 20}]
        fields = {"tools": None, "tool_choice": None, "chat_template_kwargs": None, "add_generation_prompt": True}
        return SimpleNamespace(messages=messages, cache_salt=salt, **fields)

    a, b = router._key(pending("a", chat("salt-a"))), router._key(pending("b", chat("salt-b")))
    unsalted, unusable = router._key(pending("n", chat(None))), router._key(pending("x", chat([1])))
    assert a is not None and b is not None and unsalted is not None
    assert a.blocks and not set(a.blocks) & set(b.blocks) and a.home != b.home and a.whole != b.whole
    assert unusable == unsalted != a
