"""The response stores' shared contract, on the in-process store and on a real Redis (Debian's
redis-server, as production's store is one); a background answer's readers; previous_response_id."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import pytest

from serve_app.config import RedisStoreConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.answer_log.follow import CANCELLED, QUIET_S, REPLICA_LOST, end_if_orphaned, finish, follow
from serve_app.front_door.answer_log.history import output_as_input, with_history
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.redis_client import StoreUnavailable, connect
from serve_app.front_door.answer_log.store import ResponseStore, event_type, split_events
from serve_app.front_door.core.background import BackgroundAnswers, produce_response
from serve_app.front_door.core.permit import Permit
from tests.unit.front_door.stores import OTHER, OWNER, ScriptedGeneration, event, response, unique
from tests.waiting import wait_until


async def test_a_response_is_its_owners_alone(make_store):
    store = make_store()
    rid = unique("owned")
    await store.save(rid, OWNER, response(rid), [{"role": "user", "content": "hi"}], background=False)
    assert (await store.load(rid, OWNER)).response == response(rid)
    assert await store.load(rid, OTHER) is None
    assert await store.input_items(rid) == [{"role": "user", "content": "hi"}]
    await store.update(rid, response(rid, "completed"))
    assert (await store.load(rid, OWNER)).finished
    await store.delete(rid)
    assert await store.load(rid, OWNER) is None and not await store.exists(rid)


async def test_an_owner_keeps_at_most_its_bound_and_loses_its_oldest(make_store):
    store = make_store(max_per_key=2)
    owner = unique("owner")
    ids = [unique(f"n{i}") for i in range(3)]
    for rid in ids:
        await store.save(rid, owner, response(rid), [], background=False)
    assert [await store.load(rid, owner) is not None for rid in ids] == [False, True, True]


async def test_a_response_expires_after_its_time(make_store):
    """Gone within its time and a little (both stores expire lazily or on a timer), never before it."""
    store = make_store(ttl_s=0.3)
    rid = unique("expiring")
    began = time.monotonic()
    await store.save(rid, OWNER, response(rid), [], background=True)
    await store.append(rid, 0, event("response.created", 0))

    async def gone() -> bool:
        return await store.load(rid, OWNER) is None and not await store.read(rid, -1, 0.01)

    await wait_until(gone, 10, "the response and its log expired", every_s=0.05)
    assert time.monotonic() - began >= 0.3


async def test_a_sequence_number_is_taken_once_and_read_after_any_number(make_store):
    store = make_store()
    rid = unique("log")
    await store.save(rid, OWNER, response(rid), [], background=True)
    assert await store.append(rid, 0, event("response.created", 0))
    assert await store.append(rid, 1, event("response.in_progress", 1))
    assert not await store.append(rid, 1, event("error", 1))  # a second writer of 1
    assert not await store.append(rid, 0, event("error", 0))
    assert [n for n, _ in await store.read(rid, -1, 0.01)] == [0, 1]
    assert await store.read(rid, 0, 0.01) == [(1, event("response.in_progress", 1))]
    assert await store.read(rid, 1, 0.01) == []


async def test_a_reader_waiting_at_the_tail_gets_the_next_event(make_store):
    store = make_store()
    rid = unique("tail")
    await store.save(rid, OWNER, response(rid), [], background=True)
    reading = asyncio.create_task(store.read(rid, -1, 30))
    await asyncio.sleep(0.05)  # (the reader is waiting; the append below must wake it, not its timeout)
    await store.append(rid, 0, event("response.created", 0))
    assert await asyncio.wait_for(reading, 30) == [(0, event("response.created", 0))]


async def test_a_lease_lapses_unless_renewed(make_store):
    store = make_store()
    rid = unique("lease")
    await store.save(rid, OWNER, response(rid), [], background=True)
    assert not await store.leased(rid)
    await store.renew_lease([rid], 0.3)
    assert await store.leased(rid)
    await wait_until(lambda: _not(store.leased(rid)), 10, "the lease lapsed", every_s=0.05)


async def _not(result) -> bool:
    return not await result


async def test_a_cancel_reaches_every_listener(make_store):
    store = make_store()
    heard: list[str] = []

    async def listen() -> None:
        async for response_id in store.cancel_requests():
            heard.append(response_id)

    listener = asyncio.create_task(listen())
    rid = unique("cancel")

    async def asked() -> bool:  # (a Redis subscription starts after its SUBSCRIBE is answered)
        await store.request_cancel(rid)
        return rid in heard

    await wait_until(asked, 10, "the cancel heard", every_s=0.1)
    listener.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await listener


async def test_readers_of_an_answer_whose_replica_died_all_get_one_failure_event(make_store):
    """No lease (its producer's replica is gone): each reader reads what was logged, then the
    failure one of them wrote, and the response is failed."""
    store = make_store()
    rid = unique("orphan")
    queued = response(rid)
    await store.save(rid, OWNER, queued, [], background=True)
    for n, kind in enumerate(["response.created", "response.output_text.delta"]):
        await store.append(rid, n, event(kind, n))

    async def read_all() -> list[str]:
        return [e async for e in follow(store, queued, -1, 0.05)]

    first, second = await asyncio.gather(read_all(), read_all())
    assert first == second and [event_type(e) for e in first] == [
        "response.created",
        "response.output_text.delta",
        "error",
    ]
    assert '"code": "replica_lost"' in first[-1] and '"sequence_number": 2' in first[-1]
    assert (await store.load(rid, OWNER)).status == "failed"


class CountedStore:
    """A store whose calls are kept, by name and arguments: what a reader asks of it."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls.append((name, args))
            return method(*args, **kwargs)

        return counted


async def test_a_follower_of_an_answer_deleted_while_it_runs_ends_gone_after_one_short_read(make_store):
    """Deleted under its reader while its producer still holds the lease: the reader ends with
    ``response_gone`` after one more read, of at most a second however long its caller would
    wait, and one look; it read and asked for the lease again and again until the lease lapsed
    (the in-process store answers both at once, so that loop never let the replica's event loop
    turn: 1.18 M reads in a second in issue 78)."""
    backing = make_store()
    store = CountedStore(backing)
    rid = unique("deleted")
    queued = response(rid)
    await backing.save(rid, OWNER, queued, [], background=True)
    await backing.renew_lease([rid], 2)  # (bounds the old loop: it ended once the lease lapsed)
    await backing.append(rid, 0, event("response.created", 0))
    read: list[str] = []
    before_delete = 0
    async for logged in follow(store, queued, -1, 30.0):
        read.append(logged)
        if len(read) == 1:
            await backing.delete(rid)
            before_delete = len(store.calls)
    assert [event_type(e) for e in read] == ["response.created", "error"]
    assert '"code": "response_gone"' in read[-1] and '"sequence_number": 1' in read[-1]
    after_delete = store.calls[before_delete:]
    assert [name for name, _ in after_delete] == ["read", "exists"], after_delete[:5]
    assert after_delete[0][1][2] == QUIET_S == 1.0  # the read's wait


async def test_a_producer_whose_answer_a_reader_ended_stops_and_writes_nothing_more(make_store):
    """A reader ends a running answer (its lease seen lapsed) between two of its events: the
    producer's next event is refused, and it stops at once, closing its generation (which aborts
    the engine request), with the reader's end the answer's only one: ``failed``, never then
    ``completed`` (issue 78: ``in_progress`` -> ``failed`` -> ``incomplete``)."""
    store = make_store()
    rid = unique("two-writers")
    queued = response(rid)
    await store.save(rid, OWNER, queued, [], background=True)
    completed = {"type": "response.completed", "sequence_number": 3, "response": response(rid, "completed")}
    script = [
        event("response.created", 0),
        event("response.output_text.delta", 1),
        event("response.output_text.delta", 2),
        f"event: response.completed\ndata: {json.dumps(completed)}\n\n",
    ]

    async def a_reader_ends_it_before_the_third(number: int) -> None:
        if number == 2:
            assert await finish(store, queued, 2, None, REPLICA_LOST)

    generation = ScriptedGeneration(script, a_reader_ends_it_before_the_third)

    async def permit() -> Any:
        return None

    await produce_response(store, queued, permit, lambda _permit, _deadline: generation, TimeLimits(60, 60))
    assert generation.closed and generation.yielded == 3  # the refused event was its last
    logged = [event_type(e) for _, e in await store.read(rid, -1, 0)]
    assert logged == ["response.created", "response.output_text.delta", "error"]
    ended = await store.load(rid, OWNER)
    assert ended.status == "failed" and ended.response["error"]["code"] == "replica_lost"


async def test_a_reader_after_the_last_event_of_an_ended_answer_reads_nothing_and_writes_nothing(make_store):
    """Resumed after the final event (its producer gone, as it is once the answer ended): nothing to
    read, and the log and the response stay as they ended (not a ``replica_lost`` past the end)."""
    store = make_store()
    rid = unique("ended")
    await store.save(rid, OWNER, response(rid), [], background=True)
    for n, kind in enumerate(["response.created", "response.completed"]):
        await store.append(rid, n, event(kind, n))
    await store.update(rid, response(rid, "completed"))
    assert [e async for e in follow(store, response(rid), 1, 0.05)] == []
    assert [event_type(e) for _, e in await store.read(rid, -1, 0)] == ["response.created", "response.completed"]
    assert (await store.load(rid, OWNER)).status == "completed"


async def test_a_get_of_an_answer_whose_replica_died_ends_it_failed(make_store):
    store = make_store()
    rid = unique("orphan-get")
    await store.save(rid, OWNER, response(rid, "in_progress"), [], background=True)
    await store.renew_lease([rid], 60)
    leased = await store.load(rid, OWNER)
    assert await end_if_orphaned(store, leased) == leased  # its producer lives: as it is
    other = unique("orphan-get-lapsed")
    await store.save(other, OWNER, response(other, "in_progress"), [], background=True)
    await store.append(other, 0, event("response.created", 0))
    ended = await end_if_orphaned(store, await store.load(other, OWNER))
    assert ended.status == "failed" and ended.response["error"]["code"] == "replica_lost"
    assert [n for n, _ in await store.read(other, -1, 0.01)] == [0, 1]


async def test_a_reader_resumes_after_the_number_it_saw_last(make_store):
    store = make_store()
    rid = unique("resume")
    queued = response(rid)
    await store.save(rid, OWNER, queued, [], background=True)
    events = [event("response.created", 0), event("response.output_text.delta", 1), event("response.completed", 2)]
    for n, text in enumerate(events):
        await store.append(rid, n, text)
    assert [e async for e in follow(store, queued, 0, 0.05)] == events[1:]


async def test_a_cancelled_answer_ends_with_its_error_event_and_status(make_store):
    store = make_store()
    rid = unique("cancelled")
    await store.save(rid, OWNER, response(rid, "in_progress"), [], background=True)
    assert await finish(store, response(rid, "in_progress"), 0, None, CANCELLED)
    assert not await finish(store, response(rid, "in_progress"), 0, None, CANCELLED)  # once
    assert (await store.load(rid, OWNER)).status == "cancelled"
    ((_, last),) = await store.read(rid, -1, 0.01)
    assert event_type(last) == "error" and "response_cancelled" in last


async def test_a_previous_response_becomes_the_conversation_before_the_input(make_store):
    store = make_store()
    rid = unique("previous")
    answered = response(rid, "completed") | {
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "id": "fc_1"},
        ]
    }
    await store.save(rid, OWNER, answered, [{"type": "message", "role": "user", "content": "Hi"}], background=False)
    fields = await with_history(
        {"input": [{"type": "function_call_output", "call_id": "c1", "output": "sunny"}], "previous_response_id": rid},
        store,
        OWNER,
    )
    assert fields["input"] == [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": "Hello"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    with pytest.raises(APIError) as other:
        await with_history({"input": "x", "previous_response_id": rid}, store, OTHER)
    assert (other.value.status, other.value.param) == (404, "previous_response_id")


async def test_a_previous_response_still_answered_cannot_be_continued(make_store):
    store = make_store()
    rid = unique("running")
    await store.save(rid, OWNER, response(rid, "in_progress"), [], background=True)
    with pytest.raises(APIError) as refused:
        await with_history({"input": "x", "previous_response_id": rid}, store, OWNER)
    assert (refused.value.status, refused.value.param) == (400, "previous_response_id")


def test_output_items_become_input_items():
    assert output_as_input({"output": [{"type": "reasoning", "summary": []}]}) == []


def test_coalesced_events_are_split_one_by_one():
    chunk = event("response.output_text.delta", 3) + event("response.output_text.delta", 4)
    assert split_events(chunk) == [event("response.output_text.delta", 3), event("response.output_text.delta", 4)]


def test_a_configured_redis_whose_address_is_not_in_the_environment_stops_the_replica(monkeypatch):
    monkeypatch.delenv("RESPONSES_STORE_URL", raising=False)
    with pytest.raises(StoreUnavailable, match="RESPONSES_STORE_URL"):
        connect(RedisStoreConfig())


async def test_a_stopping_replica_waits_for_its_background_answers():
    """What the replica's shutdown awaits before it stops its engine (ModelServer.__del__)."""
    store = MemoryStore(60, 10)
    answers = BackgroundAnswers(store, limit=2, lease_s=60)
    release = asyncio.Event()
    ended: list[str] = []

    def answer(name: str):
        async def produce(get_permit) -> None:
            await get_permit()
            await release.wait()
            ended.append(name)

        return produce

    def start(name: str):
        keep = store.save(f"resp_{name}", OWNER, {}, [], background=True)
        return answers.start(f"resp_{name}", None, Permit(None), 1, keep, answer(name))

    for name in ("a", "b"):
        await start(name)
        assert await store.leased(f"resp_{name}")
    with pytest.raises(APIError) as refused:
        await start("c")
    assert (refused.value.status, refused.value.code) == (429, "background_limit")
    draining = asyncio.create_task(answers.drain())
    await asyncio.sleep(0.05)  # (the drain is waiting: it must still be, with the answers under way)
    assert not draining.done()
    release.set()
    await asyncio.wait_for(draining, 10)
    assert sorted(ended) == ["a", "b"]
    await answers.close()


async def test_an_answer_being_generated_is_kept_while_its_lease_is_renewed(make_store):
    store = make_store(ttl_s=0.3)
    rid = unique("renewed")
    await store.save(rid, OWNER, response(rid, "in_progress"), [], background=True)
    for _ in range(4):  # renewed past its expiry more than once
        await store.renew_lease([rid], 0.3)
        await asyncio.sleep(0.15)  # (half its time to live between renewals: what is proven is it is still kept)
    assert await store.load(rid, OWNER) is not None
