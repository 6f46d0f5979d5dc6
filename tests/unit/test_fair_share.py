"""Fair share between API keys on one replica (serve_app.ingress.capacity): the rule, the ranks, and
what they do to waiting requests in an engine that schedules by priority (the simulated batch)."""

from __future__ import annotations

import pytest
from ray.serve.exceptions import BackPressureError

from serve_app.config import SimulatedEngineConfig
from serve_app.errors import APIError
from serve_app.ingress.auth import APIKeys
from serve_app.ingress.capacity import (
    FairShare,
    GenerationSlots,
    KeyRanks,
    QueueShare,
    SlotHold,
    give_back_queue_place,
)
from serve_app.ingress.deadlines import TimeLimits
from serve_app.observability.record import RequestRecord
from serve_app.protocol import Reply
from serve_app.serve_internals import QueueState
from serve_app.simulated_engine.batch import ContinuousBatch
from serve_app.simulated_engine.timing import GpuTiming
from tests.unit.fake_ingress import CHAT, assert_openai_error, client_for
from tests.unit.test_simulated_engine import VOCABULARY, sequence


def test_a_replica_keeps_one_batch_of_places_at_most_half_of_its_queue() -> None:
    assert FairShare.for_replica(limit=576, runs_at_once=64).kept == 64  # 64 run, 512 wait
    assert FairShare.for_replica(limit=96, runs_at_once=64).kept == 16  # 32 wait: half
    assert FairShare.for_replica(limit=64, runs_at_once=64).kept == 0  # nothing waits: nothing kept


def test_only_kept_places_left_go_to_keys_holding_less_than_their_part() -> None:
    rule = FairShare(limit=100, kept=20)
    assert rule.admits(held=79, key_held=79, other_keys=0)  # 21 free: anyone
    assert not rule.admits(held=80, key_held=80, other_keys=0)  # 20 free, all kept: a lone key holds its part
    assert rule.admits(held=80, key_held=0, other_keys=1)  # a newcomer takes one: part 20 / 2
    assert rule.admits(held=89, key_held=9, other_keys=1)
    assert not rule.admits(held=90, key_held=10, other_keys=1)
    assert rule.allowance(other_keys=3) == 5 and FairShare(limit=10, kept=1).allowance(other_keys=4) == 1


def test_a_flooding_key_leaves_the_kept_places_to_another_and_each_request_has_its_keys_rank() -> None:
    slots = GenerationSlots(limit=10, fair_share=FairShare(limit=10, kept=4))
    assert [slots.take(key_id="a") for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(APIError) as refused:
        slots.take(key_id="a")
    assert (refused.value.status, refused.value.code, refused.value.headers) == (
        429,
        "fair_share_exceeded",
        {"Retry-After": "1"},
    )
    assert "holds 6" in refused.value.message
    assert [slots.take(key_id="b") for _ in range(2)] == [0, 1]  # 4 kept / (1 other + 1)
    with pytest.raises(APIError):
        slots.take(key_id="b")
    assert slots.take(key_id="c") == 0  # 4 // 3 = 1
    assert slots.take(key_id="d") == 0  # allowance is never below one
    with pytest.raises(APIError) as full:
        slots.take(key_id="e")
    assert full.value.code == "overloaded"
    slots.give_back("a", rank=5)
    slots.give_back("d", rank=0)
    assert slots.held == 8 and slots.by_key == {"a": 5, "b": 2, "c": 1}
    with pytest.raises(APIError):  # 2 free, both kept: a still holds more than 4 // (2 others + 1)
        slots.take(key_id="a")
    assert slots.take(key_id="d") == 0
    for rank in (4, 3, 2, 1):
        slots.give_back("a", rank=rank)
    assert slots.take(key_id="a") == 1  # 5 free: more than the kept places, for anyone


def test_a_keys_newer_request_never_ranks_below_one_its_key_still_holds() -> None:
    """A key's count falls as its older requests end; its newer requests keep the rank of the
    highest it still holds, so they neither pass its waiting ones nor preempt its running ones."""
    ranks = KeyRanks()
    assert [ranks.take("a") for _ in range(4)] == [0, 1, 2, 3]
    for rank in (0, 1, 2):  # its oldest end first; the one ranked 3 still waits
        ranks.give_back("a", rank, 1)
    assert ranks.held == {"a": 1}
    assert ranks.take("a") == 3  # not 1: after the one it came after
    assert ranks.take("b") == 0  # another key's rank is its own count
    ranks.give_back("a", 3, 1)
    assert ranks.take("a") == 3  # still held: the other ranked 3
    ranks.give_back("a", 3, 1)
    ranks.give_back("a", 3, 1)
    assert "a" not in ranks.held and ranks.take("a") == 0  # nothing held: a fresh count
    slots = GenerationSlots(limit=10, fair_share=FairShare(limit=10, kept=2))
    holds = [SlotHold(slots, "a", slots.take(key_id="a")) for _ in range(3)]
    holds[0].give_back()
    holds[0].give_back()  # (once only)
    holds[1].give_back()
    assert slots.take(key_id="a") == 2 and slots.by_key == {"a": 2}  # a direct replica's places
    share = QueueShare(lambda: QueueState(queued=0, limit=10), runs_at_once=4)
    queued = [share.take("a") for _ in range(3)]
    queued[0].give_back()
    queued[1].give_back()
    assert share.take("a").rank == 2  # the relay path's


def test_the_relay_path_keeps_one_batch_of_serves_queue_at_most_half() -> None:
    assert FairShare.for_queue(limit=512, runs_at_once=64).kept == 64
    assert FairShare.for_queue(limit=40, runs_at_once=64).kept == 20


def test_on_the_relay_path_a_key_past_its_part_of_a_nearly_full_queue_is_refused_and_ranks_count_requests() -> None:
    queue = QueueState(queued=0, limit=10)
    share = QueueShare(lambda: queue, runs_at_once=4)  # kept: 4 of the queue's 10
    holds = [share.take("a") for _ in range(6)]
    assert [hold.rank for hold in holds] == [0, 1, 2, 3, 4, 5]
    queue = QueueState(queued=6, limit=10)  # 4 free, all kept: a holds more than its part
    record = RequestRecord("chat")
    with pytest.raises(APIError) as refused:
        share.take("a", record)
    assert (refused.value.status, refused.value.code, record.error_code) == (429, *["fair_share_exceeded"] * 2)
    assert "queue is nearly full" in refused.value.message and "holds 6" in refused.value.message
    assert share.take("b").rank == 0  # a light key still finds a place
    queue = QueueState(queued=10, limit=10)  # full: Serve refuses it (429 overloaded), not this share
    assert share.take("c").rank == 0
    holds[0].give_back()
    holds[0].give_back()  # (once only)
    assert share.by_key == {"a": 5, "b": 1, "c": 1}
    unbounded = QueueShare(lambda: QueueState(queued=10_000, limit=-1), runs_at_once=4)
    assert [unbounded.take("a").rank for _ in range(3)] == [0, 1, 2]  # no max_queued_requests: nothing kept


def test_a_relayed_requests_place_is_given_back_when_it_ends() -> None:
    share = QueueShare(lambda: QueueState(queued=0, limit=10), runs_at_once=4)
    record = RequestRecord("chat", queue_hold=share.take("a"))
    give_back_queue_place(record)
    give_back_queue_place(RequestRecord("chat"))  # (a request that took none)
    assert share.by_key == {}


HEAVY, LIGHT = "sk-heavy-0123456789abcdef", "sk-light-0123456789abcdef"


def test_a_relayed_request_is_sent_with_its_keys_rank_and_refused_past_its_share_of_a_nearly_full_queue() -> None:
    """The ingress app (relay path) holds each request's place in the model's QueueShare."""
    keys = APIKeys("test keys", lambda: f"{HEAVY}\n{LIGHT}\n")
    queue = QueueState(queued=0, limit=10)
    share = QueueShare(lambda: queue, runs_at_once=4)
    client, handle = client_for([Reply(200, b"{}")], api_keys=keys, queue_share=share)
    heavy = keys.identify(HEAVY)
    assert heavy is not None
    held = [share.take(heavy) for _ in range(3)]  # three of its requests under way
    handle.on_call = lambda: seen.append(dict(share.by_key))
    seen: list[dict] = []

    def chat_as(key: str):
        return client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})

    assert chat_as(HEAVY).status_code == 200
    assert [p.priority for p in handle.payloads] == [3] and seen == [{heavy: 4}]  # held while sent
    assert share.by_key == {heavy: 3}  # given back as it ended
    light = keys.identify(LIGHT)
    assert light is not None
    held.append(share.take(light))  # one of the light key's: each key's part is 4 kept / 2 keys
    queue = QueueState(queued=7, limit=10)  # 3 free, all kept: only keys within their part
    refused = chat_as(HEAVY)
    assert_openai_error(refused, 429)
    assert refused.json()["error"]["code"] == "fair_share_exceeded" and refused.headers["retry-after"] == "1"
    assert len(handle.payloads) == 1  # never sent
    assert chat_as(LIGHT).status_code == 200 and handle.payloads[-1].priority == 1
    for hold in held:
        hold.give_back()
    assert share.by_key == {}


def test_a_place_is_kept_for_a_request_of_a_key_within_its_part_of_the_queue() -> None:
    queue = QueueState(queued=0, limit=10)
    share = QueueShare(lambda: queue, runs_at_once=4)  # kept: 4 of the queue's 10
    assert [share.take("a").within_part for _ in range(6)] == [True] * 4 + [False] * 2  # its part: all 4
    assert share.take("b").within_part  # two keys: each one's part is 2
    assert not QueueShare(lambda: QueueState(queued=0, limit=-1), runs_at_once=4).take("a").within_part  # none kept


def test_a_relayed_request_a_place_is_kept_for_waits_out_serves_full_queue_and_one_past_its_part_gets_429() -> None:
    """Serve's count of its queue lags a burst of requests admitted here, so Serve may refuse a
    request the share admitted into a kept place: that one is offered again until Serve takes it,
    with its rank; a request of a key past its part gets Serve's 429 at once."""
    keys = APIKeys("test keys", lambda: f"{HEAVY}\n{LIGHT}\n")
    heavy, light = keys.identify(HEAVY), keys.identify(LIGHT)
    assert heavy is not None and light is not None
    share = QueueShare(lambda: QueueState(queued=0, limit=10), runs_at_once=4)
    full = BackPressureError(num_queued_requests=10, max_queued_requests=10)
    client, handle = client_for([full], then=[[full], [full], [Reply(200, b"{}")]], api_keys=keys, queue_share=share)
    held = [share.take(heavy) for _ in range(4)]  # all of its part, under way

    def chat_as(key: str):
        return client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})

    refused = chat_as(HEAVY)
    assert_openai_error(refused, 429)
    assert refused.json()["error"]["code"] == "overloaded" and len(handle.payloads) == 1
    answered = chat_as(LIGHT)
    assert answered.status_code == 200, answered.text
    assert [p.priority for p in handle.payloads[1:]] == [0, 0, 0]  # refused twice, then taken
    for hold in held:
        hold.give_back()
    assert share.by_key == {}


def test_a_request_waiting_for_a_kept_place_gets_serves_429_when_its_first_token_would_be_late() -> None:
    keys = APIKeys("test keys", lambda: f"{LIGHT}\n")
    share = QueueShare(lambda: QueueState(queued=0, limit=10), runs_at_once=4)
    full = BackPressureError(num_queued_requests=10, max_queued_requests=10)
    client, handle = client_for([full], api_keys=keys, queue_share=share, limits=TimeLimits(600, 1.0))
    response = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {LIGHT}"})
    assert_openai_error(response, 429)
    assert response.json()["error"]["code"] == "overloaded" and len(handle.payloads) > 1  # offered again first
    assert share.by_key == {}


def test_without_fair_share_or_a_key_every_request_has_rank_zero_up_to_the_limit() -> None:
    plain = GenerationSlots(limit=2)
    assert [plain.take(key_id="a"), plain.take(key_id="a")] == [0, 0]
    with pytest.raises(APIError):
        plain.take(key_id="b")
    fair = GenerationSlots(limit=2, fair_share=FairShare(limit=2, kept=1))
    assert [fair.take(), fair.take()] == [0, 0]  # no API keys: one tenant
    assert fair.by_key == {}


def test_held_places_are_given_back_when_the_block_ends_even_on_error() -> None:
    slots = GenerationSlots(limit=3, fair_share=FairShare(limit=3, kept=1))
    with pytest.raises(RuntimeError), slots.hold(key_id="a") as hold:
        assert hold.rank == 0 and slots.by_key == {"a": 1}
        hold.grow_to(2)
        assert slots.by_key == {"a": 2}
        raise RuntimeError
    assert slots.held == 0 and slots.by_key == {}


def run(batch: ContinuousBatch, first: dict[str, float], until: str, clock_s: float = 0.0) -> float:
    """Step the batch until ``until`` has its first token, noting when each sequence got its first."""
    while until not in first:
        step = batch.schedule(clock_s)
        assert step is not None
        clock_s = step.end_s
        for emitted in batch.complete(step):
            first.setdefault(emitted.sequence.request_id, clock_s)
    return clock_s


def test_with_priority_scheduling_a_light_key_waits_one_turnover_behind_a_flood() -> None:
    """Key A's 40 requests fill a 4-sequence batch and its queue; key B's one request, ranked 0
    by its key's count, joins at the first freed sequence slot, not after A's 36 waiting ones.
    In arrival order (first come, first served) it would wait for all of them."""
    timing = GpuTiming.from_config(SimulatedEngineConfig())
    started_before_b = {}
    for by_priority in (True, False):
        batch = ContinuousBatch(timing, max_num_seqs=4, vocabulary=VOCABULARY, by_priority=by_priority)
        slots = GenerationSlots(limit=64, fair_share=FairShare(limit=64, kept=4))
        first: dict[str, float] = {}
        for i in range(40):
            batch.add(sequence(f"a{i}", prompt=16, max_tokens=8, priority=slots.take(key_id="a")))
        clock_s = run(batch, first, "a0")
        batch.add(sequence("b", prompt=16, max_tokens=8, arrival_s=clock_s, priority=slots.take(key_id="b")))
        run(batch, first, "b", clock_s)
        started_before_b[by_priority] = sum(1 for name, at in first.items() if at < first["b"]) - 4
    assert started_before_b == {True: 0, False: 36}
