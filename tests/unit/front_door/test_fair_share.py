"""Fair share between API keys on one replica (serve_app.front_door.admission.capacity): the rule, the ranks, and
what they do to waiting requests in an engine that schedules by priority (the simulated batch)."""

from __future__ import annotations

import pytest

from serve_app.config import SimulatedEngineConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.capacity import (
    FairShare,
    GenerationSlots,
    KeyRanks,
    SlotHold,
)
from serve_app.simulated_engine.batch import ContinuousBatch
from serve_app.simulated_engine.timing import GpuTiming
from tests.unit.simulated_engine.batches import VOCABULARY, sequence


def test_a_replica_keeps_one_batch_of_places_at_most_half_of_its_queue() -> None:
    assert FairShare.for_replica(limit=576, runs_at_once=64).reserved == 64  # 64 run, 512 wait
    assert FairShare.for_replica(limit=96, runs_at_once=64).reserved == 16  # 32 wait: half
    assert FairShare.for_replica(limit=64, runs_at_once=64).reserved == 0  # nothing waits: nothing kept


def test_only_kept_places_left_go_to_keys_holding_less_than_their_part() -> None:
    rule = FairShare(limit=100, reserved=20)
    assert rule.admits(held=79, key_held=79, other_keys=0)  # 21 free: anyone
    assert not rule.admits(held=80, key_held=80, other_keys=0)  # 20 free, all kept: a lone key holds its part
    assert rule.admits(held=80, key_held=0, other_keys=1)  # a newcomer takes one: part 20 / 2
    assert rule.admits(held=89, key_held=9, other_keys=1)
    assert not rule.admits(held=90, key_held=10, other_keys=1)
    assert rule.allowance(other_keys=3) == 5 and FairShare(limit=10, reserved=1).allowance(other_keys=4) == 1


def test_a_flooding_key_leaves_the_kept_places_to_another_and_each_request_has_its_keys_rank() -> None:
    slots = GenerationSlots(limit=10, fair_share=FairShare(limit=10, reserved=4))
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
    slots = GenerationSlots(limit=10, fair_share=FairShare(limit=10, reserved=2))
    holds = [SlotHold(slots, "a", slots.take(key_id="a")) for _ in range(3)]
    holds[0].give_back()
    holds[0].give_back()  # (once only)
    holds[1].give_back()
    assert slots.take(key_id="a") == 2 and slots.by_key == {"a": 2}  # a replica's places


def test_without_fair_share_or_a_key_every_request_has_rank_zero_up_to_the_limit() -> None:
    plain = GenerationSlots(limit=2)
    assert [plain.take(key_id="a"), plain.take(key_id="a")] == [0, 0]
    with pytest.raises(APIError):
        plain.take(key_id="b")
    fair = GenerationSlots(limit=2, fair_share=FairShare(limit=2, reserved=1))
    assert [fair.take(), fair.take()] == [0, 0]  # no API keys: one tenant
    assert fair.by_key == {}


def test_held_places_are_given_back_when_the_block_ends_even_on_error() -> None:
    slots = GenerationSlots(limit=3, fair_share=FairShare(limit=3, reserved=1))
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
        slots = GenerationSlots(limit=64, fair_share=FairShare(limit=64, reserved=4))
        first: dict[str, float] = {}
        for i in range(40):
            batch.add(sequence(f"a{i}", prompt=16, max_tokens=8, priority=slots.take(key_id="a")))
        clock_s = run(batch, first, "a0")
        batch.add(sequence("b", prompt=16, max_tokens=8, arrival_s=clock_s, priority=slots.take(key_id="b")))
        run(batch, first, "b", clock_s)
        started_before_b[by_priority] = sum(1 for name, at in first.items() if at < first["b"]) - 4
    assert started_before_b == {True: 0, False: 36}
