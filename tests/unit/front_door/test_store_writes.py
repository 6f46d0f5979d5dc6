"""What a write to the answer log may do, on both stores: statuses only move forward, a response
that is gone takes no write, a retried append is one event; and, on Redis, a log that lost its
last events to a failover gets them again, and a Redis that does not answer is a 503 to a
request and waited out by a running answer (issue 78)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis import asyncio as aioredis

from serve_app.config import RedisStoreConfig
from serve_app.errors import APIError
from serve_app.front_door.answer_log.follow import REPLICA_LOST, finish
from serve_app.front_door.answer_log.patient import PatientStore
from serve_app.front_door.answer_log.redis_client import connect, options
from serve_app.front_door.answer_log.redis_store import PREFIX, RedisStore
from serve_app.front_door.answer_log.store import StoreDown
from tests.unit.front_door.cores import ALPHA, MODEL, client, core_with, key
from tests.unit.front_door.stores import OTHER, OWNER, event, response, unique
from tests.waiting import wait_until
from tools.local_redis import LocalRedis


async def test_a_status_moves_forward_and_a_final_one_never_changes(make_store):
    """``queued`` -> ``in_progress`` -> one final status; an update back, or past a final status
    (a late writer's ``completed`` after a reader ended it ``failed``), is refused and changes nothing."""
    store = make_store()
    rid = unique("statuses")
    await store.save(rid, OWNER, response(rid), [], background=True)
    assert await store.update(rid, response(rid, "in_progress"))
    assert not await store.update(rid, response(rid, "queued"))
    assert await store.update(rid, response(rid, "failed"))
    for late in ("completed", "incomplete", "in_progress", "failed"):
        assert not await store.update(rid, response(rid, late))
    assert (await store.load(rid, OWNER)).status == "failed"


async def test_the_second_of_two_writers_ending_an_answer_is_told_it_was_not_its_end(make_store):
    """Two readers end the same orphaned answer at once: one end is logged and kept, and the
    other learns it ended nothing (its event was the same; its status update is refused)."""
    store = make_store()
    rid = unique("two-ends")
    queued = response(rid)
    await store.save(rid, OWNER, queued, [], background=True)
    await store.append(rid, 0, event("response.created", 0))
    ends = await asyncio.gather(*(finish(store, queued, 1, None, REPLICA_LOST) for _ in range(2)))
    assert sorted(ends) == [False, True]
    assert len(await store.read(rid, -1, 0)) == 2 and (await store.load(rid, OWNER)).status == "failed"


async def test_a_response_that_is_gone_takes_no_write(make_store):
    """Deleted (or expired) under its producer: its next append and its status update are refused,
    and nothing of it is written again (no ownerless object, no log)."""
    store = make_store()
    rid = unique("gone")
    await store.save(rid, OWNER, response(rid), [], background=True)
    await store.append(rid, 0, event("response.created", 0))
    await store.delete(rid)
    assert not await store.append(rid, 1, event("response.output_text.delta", 1))
    assert not await store.update(rid, response(rid, "completed"))
    assert not await store.exists(rid) and await store.read(rid, -1, 0) == []
    if isinstance(store, RedisStore):
        assert await store.redis.keys(f"{PREFIX}{rid}*") == []
        assert await store.redis.zscore(f"{PREFIX}owner:{OWNER}", rid) is None  # (its owner's bound forgot it)


async def test_an_append_made_again_is_one_event_and_another_event_under_its_number_is_refused(make_store):
    """A call retried after its first try was written (its answer lost on the way) is taken as done."""
    store = make_store()
    rid = unique("retried")
    await store.save(rid, OWNER, response(rid), [], background=True)
    assert await store.append(rid, 0, event("response.created", 0))
    assert await store.append(rid, 0, event("response.created", 0))
    assert not await store.append(rid, 0, event("response.in_progress", 0))
    assert not await store.append(rid, 2, event("response.in_progress", 2))  # (not the next number)
    assert [n for n, _ in await store.read(rid, -1, 0)] == [0]


async def lose_after(store: RedisStore, response_id: str, kept: int) -> None:
    """The log as a promoted replica has it that had events up to ``kept`` only (Redis's own stream,
    its top id that of its last entry)."""
    log = f"{PREFIX}{response_id}:events"
    entries = await store.redis.xrange(log, "-", f"0-{kept + 1}")
    await store.redis.delete(log)
    for entry_id, fields in entries:
        await store.redis.xadd(log, fields, id=entry_id)


@pytest.fixture
async def redis_store(redis_server) -> AsyncIterator[RedisStore]:
    store = RedisStore(aioredis.Redis(port=redis_server.port, password=redis_server.password), 60, 100)
    yield store
    await store.close()


async def test_a_log_that_lost_its_last_events_gets_them_again_from_their_writer(redis_store):
    """A failover's new primary may lack the old one's last writes: the writer's next append finds
    the log short and writes the missing events again, so the log reads whole and in order."""
    rid = unique("failed-over")
    await redis_store.save(rid, OWNER, response(rid), [], background=True)
    events = [event("response.output_text.delta", n) for n in range(6)]
    for n in range(5):
        assert await redis_store.append(rid, n, events[n])
    await lose_after(redis_store, rid, 2)
    assert await redis_store.append(rid, 5, events[5])
    assert await redis_store.read(rid, -1, 0) == list(enumerate(events))


async def test_a_log_that_lost_more_than_its_writer_keeps_refuses_the_writer(redis_store):
    """The lost events are not this writer's to write again (another replica wrote them): refused,
    and the writer stops, rather than leave a gap readers would never see."""
    rid = unique("lost")
    await redis_store.save(rid, OWNER, response(rid), [], background=True)
    writer = RedisStore(redis_store.redis, 60, 100)
    for n in range(3):
        assert await writer.append(rid, n, event("response.output_text.delta", n))
    await lose_after(redis_store, rid, 1)
    assert not await redis_store.append(rid, 3, event("response.output_text.delta", 3))
    assert [n for n, _ in await redis_store.read(rid, -1, 0)] == [0, 1]


def config_of(ride_through_s: float) -> RedisStoreConfig:
    return RedisStoreConfig(url_env="STORE_URL", password_env="STORE_PASSWORD", ride_through_s=ride_through_s)


async def test_a_redis_that_does_not_answer_is_a_503_to_a_call_and_waited_out_by_a_running_answer(
    tmp_path, monkeypatch, caplog
):
    """The replica's own client (timeouts, retries) over a Redis that stops: a request's call gets
    StoreDown (503 ``store_unavailable``, Retry-After) once its retries are spent; a running
    answer's call waits, and is answered once Redis is back on its address."""
    server = LocalRedis(tmp_path / "redis").start()
    for name, value in server.env("STORE_URL", "STORE_PASSWORD").items():
        monkeypatch.setenv(name, value)
    config = config_of(ride_through_s=60)
    store = RedisStore(connect(config), 60, 100)
    rid = unique("outage")
    try:
        await store.save(rid, OWNER, response(rid), [], background=True)
        server.stop()
        with pytest.raises(StoreDown) as down:
            await store.load(rid, OWNER)
        assert down.value.status == 503 and down.value.code == "store_unavailable"
        assert down.value.headers == {"Retry-After": "5"}

        waiting = asyncio.create_task(PatientStore(store, config.ride_through_s).exists(rid))
        await wait_until(lambda: "the response store is down" in caplog.text, 30, "the answer's call failed once")
        assert not waiting.done()
        server = LocalRedis(server.root, port=server.port, password=server.password).start()  # (empty)
        assert await asyncio.wait_for(waiting, 30) is False
    finally:
        await store.close()
        server.stop()


async def test_a_running_answers_call_ends_with_store_down_once_its_wait_is_spent(tmp_path, monkeypatch):
    """Past ``ride_through_s`` the running answer's call gives up too: the store is down, not slow."""
    server = LocalRedis(tmp_path / "redis").start()
    for name, value in server.env("STORE_URL", "STORE_PASSWORD").items():
        monkeypatch.setenv(name, value)
    store = RedisStore(connect(config_of(ride_through_s=0.5)), 60, 100)
    server.stop()
    began = time.monotonic()
    try:
        with pytest.raises(StoreDown):
            await PatientStore(store, 0.5).read(unique("never"), -1, 0)
    finally:
        await store.close()
    assert time.monotonic() - began >= 0.5  # (a lower bound only: it was called again for its wait)


BOUND = 10_000  # bytes per key in the tests below
INPUT = [{"type": "message", "role": "user", "content": "x" * 2_900}]  # about 3,000 bytes a response


async def still_stored(store, ids: list[str], owner: str = OWNER) -> list[str]:
    return [rid for rid in ids if await store.load(rid, owner) is not None]


async def test_a_key_past_its_byte_bound_loses_its_own_oldest_and_no_other_keys(make_store, redis_server):
    """Five responses of about 3,000 bytes under a 10,000-byte bound: the key keeps its newest three,
    and another key's response, older than all of them, stays (Redis evicted nothing: it never does)."""
    store = make_store(max_bytes_per_key=BOUND)
    other = unique("other-key")
    await store.save(other, OTHER, response(other), INPUT, background=False)
    mine = [unique(f"mine-{n}") for n in range(5)]
    for rid in mine:
        await store.save(rid, OWNER, response(rid), INPUT, background=False)
    assert await still_stored(store, mine) == mine[2:]
    assert await still_stored(store, [other], OTHER) == [other]
    if isinstance(store, RedisStore):
        sizes = await store.redis.hgetall(f"{PREFIX}owner:{OWNER}:bytes")
        assert int(sizes[b"*"]) == sum(int(size) for rid, size in sizes.items() if rid != b"*") <= BOUND
        assert (await store.redis.info("stats"))["evicted_keys"] == 0


async def test_a_running_answers_events_count_against_its_key_and_never_shed_it(make_store):
    """An answer being generated (leased) writes events past its key's bound: the key's finished
    responses go, oldest first; the running answer, though older than them, stays whole."""
    store = make_store(max_bytes_per_key=BOUND)
    running = unique("running")
    await store.save(running, OWNER, response(running), [], background=True)
    await store.renew_lease([running], 60)
    finished = [unique(f"finished-{n}") for n in range(2)]
    for rid in finished:
        await store.save(rid, OWNER, response(rid), INPUT, background=False)
    delta = 'event: response.output_text.delta\ndata: {"delta": "' + "y" * 1_000 + '"}\n\n'
    for n in range(12):  # about 12,000 bytes of events
        assert await store.append(running, n, delta)
    assert await still_stored(store, finished) == []
    assert len(await store.read(running, -1, 0)) == 12


async def test_a_response_past_its_keys_byte_bound_on_its_own_is_refused_413(make_store):
    store = make_store(max_bytes_per_key=BOUND)
    rid = unique("huge")
    with pytest.raises(APIError) as refused:
        await store.save(rid, OWNER, response(rid), INPUT * 4, background=True)
    assert (refused.value.status, refused.value.code) == (413, "response_too_large")
    assert "max_bytes_per_key" in refused.value.message and not await store.exists(rid)


async def test_a_deleted_or_expired_response_gives_its_key_its_bytes_back(make_store):
    """Room freed by a DELETE, or by expiry, is the key's again: three more responses fit after."""
    store = make_store(ttl_s=0.5, max_bytes_per_key=BOUND)
    first = [unique(f"first-{n}") for n in range(3)]
    for rid in first:
        await store.save(rid, OWNER, response(rid), INPUT, background=False)
    await store.delete(first[0])
    await wait_until(lambda: _gone(store, first[1:]), 10, "the other two expired")
    later = [unique(f"later-{n}") for n in range(3)]
    for rid in later:
        await store.save(rid, OWNER, response(rid), INPUT, background=False)
    assert await still_stored(store, later) == later


async def _gone(store, ids: list[str]) -> bool:
    return not await still_stored(store, ids)


async def test_a_full_redis_keeps_no_new_response_and_lets_running_answers_finish(tmp_path):
    """Redis drops nothing (``noeviction``, as shipped): filled by many keys, each within its bounds,
    it refuses new responses (503 ``store_full``) once past 90% of its ``maxmemory``, while an
    answer already running appends its events to its end; nothing was evicted."""
    server = LocalRedis(tmp_path / "redis").start()
    client = aioredis.Redis(port=server.port, password=server.password)
    store = RedisStore(client, 60, 100, max_bytes_per_key=BOUND)
    try:
        assert (await client.config_get("maxmemory-policy"))["maxmemory-policy"] == "noeviction"
        used = (await client.info("memory"))["used_memory"]
        await client.config_set("maxmemory", used + (4 << 20))
        running = unique("running")
        await store.save(running, OWNER, response(running), [], background=True)
        await store.renew_lease([running], 60)
        with pytest.raises(StoreDown) as full:
            for n in range(10_000):  # keys of their own, each under its bound: only the whole fills up
                rid = unique(f"filler-{n}")
                await store.save(rid, f"key-{n}", response(rid), INPUT, background=False)
        assert (full.value.status, full.value.code) == (503, "store_full")
        for n in range(50):
            assert await store.append(running, n, event("response.output_text.delta", n))
        assert len(await store.read(running, -1, 0)) == 50
        assert (await client.info("stats"))["evicted_keys"] == 0
    finally:
        await store.close()
        server.stop()


async def test_a_stored_foreground_answer_is_answered_whole_when_the_store_is_down_at_its_end(tmp_path, caplog):
    """The store is needed only to keep the answer once it ended: a store down then costs the keeping
    (logged), not the answer, which the client gets to its last event."""
    server = LocalRedis(tmp_path / "redis").start()
    shipped = options(RedisStoreConfig())
    store = RedisStore(aioredis.Redis(port=server.port, password=server.password, **shipped), 60, 100)
    core, model, _ = core_with(store=store)
    try:
        async with client(core) as http:
            body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 8}
            posted = asyncio.create_task(http.post("/v1/responses", json=body, headers=key(ALPHA)))
            await wait_until(lambda: model.answers, 10, "the answer began")
            server.stop()
            model.answers[0].release.set()
            answer = await posted
        assert answer.status_code == 200
        assert answer.text.rstrip().split("\n\n")[-1].startswith("event: response.completed")
        assert "answered and not stored" in caplog.text
    finally:
        await store.close()
