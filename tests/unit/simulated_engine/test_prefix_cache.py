"""The simulated engine's prefix cache: what vLLM's automatic prefix caching gives a prompt, and what it costs."""

from __future__ import annotations

import pytest

from serve_app.simulated_engine.batch import ContinuousBatch
from serve_app.simulated_engine.prefix_cache import LookupTally, PrefixCache, block_hashes
from tests.unit.simulated_engine.batches import VOCABULARY, run, sequence, timing

BLOCK = 4


def prompt(*blocks: int) -> list[int]:
    """A prompt of whole blocks, each its own token repeated."""
    return [token for block in blocks for token in [block] * BLOCK]


def test_a_block_is_named_by_itself_and_everything_before_it():
    a = block_hashes(prompt(1, 2, 3), BLOCK)
    assert len(a) == 3
    assert block_hashes(prompt(1, 2, 9), BLOCK)[:2] == a[:2]
    assert block_hashes(prompt(7, 2, 3), BLOCK)[1] != a[1], "the same block after another prefix"
    assert block_hashes(prompt(1, 2) + [5, 5], BLOCK) == a[:2], "a partial block has no name"


def test_prompts_under_different_cache_salts_share_no_block():
    """As vLLM hashes a request's cache_salt into its first block: another key's prompt hits nothing."""
    cache = PrefixCache(BLOCK, capacity_blocks=100)
    cache.insert(block_hashes(prompt(1, 2, 3), BLOCK, "salt-a"))
    assert cache.hit_tokens(block_hashes(prompt(1, 2, 3, 4), BLOCK, "salt-a"), 4 * BLOCK) == 3 * BLOCK
    assert cache.hit_tokens(block_hashes(prompt(1, 2, 3, 4), BLOCK, "salt-b"), 4 * BLOCK) == 0
    assert cache.hit_tokens(block_hashes(prompt(1, 2, 3, 4), BLOCK), 4 * BLOCK) == 0


def test_a_lookup_finds_the_leading_cached_blocks_short_of_the_prompts_last_token():
    cache = PrefixCache(BLOCK, capacity_blocks=100)
    cache.insert(block_hashes(prompt(1, 2, 3), BLOCK))
    assert cache.hit_tokens(block_hashes(prompt(1, 2, 3, 4), BLOCK), 4 * BLOCK) == 3 * BLOCK
    assert cache.hit_tokens(block_hashes(prompt(1, 9, 3), BLOCK), 3 * BLOCK) == BLOCK, "stops at the first miss"
    # The whole prompt cached: its last block is computed again (the last token yields the first output).
    assert cache.hit_tokens(block_hashes(prompt(1, 2, 3), BLOCK), 3 * BLOCK) == 2 * BLOCK


def test_the_least_recently_used_blocks_go_first_when_the_cache_is_full():
    cache = PrefixCache(BLOCK, capacity_blocks=4)
    old, new = block_hashes(prompt(1, 2), BLOCK), block_hashes(prompt(5, 6), BLOCK)
    cache.insert(old)
    cache.insert(new)
    cache.admit(old, 3 * BLOCK, preempted=False)  # used again: now the most recent
    cache.insert(block_hashes(prompt(8, 9), BLOCK))
    assert len(cache) == 4
    assert cache.hit_tokens(old, 3 * BLOCK) == 2 * BLOCK
    assert cache.hit_tokens(new, 3 * BLOCK) == 0


def test_admissions_are_counted_as_vllm_counts_them_new_and_preempted_apart():
    cache = PrefixCache(BLOCK, capacity_blocks=100)
    hashes = block_hashes(prompt(1, 2, 3), BLOCK)
    assert cache.admit(hashes, 3 * BLOCK + 1, preempted=False) == 0
    cache.insert(hashes)
    assert cache.admit(hashes, 3 * BLOCK + 1, preempted=False) == 3 * BLOCK
    assert cache.admit(hashes, 3 * BLOCK + 1, preempted=True) == 3 * BLOCK
    assert cache.take_tally() == LookupTally(
        requests=2,
        queries=2 * (3 * BLOCK + 1),
        hits=3 * BLOCK,
        preempted_requests=1,
        preempted_queries=13,
        preempted_hits=12,
    )
    assert cache.take_tally() == LookupTally(), "each report has the counts since the last"
    cache.clear()
    assert cache.hit_tokens(hashes, 3 * BLOCK + 1) == 0


def test_a_repeated_prompt_prefills_only_what_the_cache_lacks_and_frees_its_kv_cache():
    cache = PrefixCache(BLOCK, capacity_blocks=1000)
    batch = ContinuousBatch(timing(), max_num_seqs=4, vocabulary=VOCABULARY, prefix_cache=cache)
    tokens = prompt(*range(1, 26))  # 100 tokens
    batch.add(sequence("first", prompt=100, max_tokens=1, block_hashes=block_hashes(tokens, BLOCK)))
    [(first_end, first)] = run(batch)
    again = sequence("again", prompt=101, max_tokens=1, arrival_s=first_end, block_hashes=block_hashes(tokens, BLOCK))
    batch.add(again)
    [(again_end, _)] = run(batch, start_s=first_end)
    assert first.sequence.cached_tokens == 0 and again.cached_tokens == 100
    # 10 ms + the KV read of 101 tokens + the prefill of 1 token (not 101).
    assert again_end - first_end == pytest.approx(0.010 + 101 * 1e-6 + 1 * 1e-4)
    assert batch.kv_used_tokens == 0
    assert cache.take_tally() == LookupTally(requests=2, queries=201, hits=100)


def test_a_preempted_sequence_rejoins_with_its_cached_prompt_and_is_counted_as_preempted():
    cache = PrefixCache(BLOCK, capacity_blocks=1000)
    batch = ContinuousBatch(timing(capacity=60), max_num_seqs=4, vocabulary=VOCABULARY, prefix_cache=cache)
    for name, first_block in (("old", 1), ("young", 50)):
        tokens = prompt(*range(first_block, first_block + 5))  # 20 tokens
        batch.add(sequence(name, prompt=20, max_tokens=30, block_hashes=block_hashes(tokens, BLOCK)))
    by_name = {e.sequence.request_id: e.sequence for _, e in run(batch)}
    assert set(by_name) == {"old", "young"}
    young = by_name["young"]
    assert young.preemptions >= 1 and young.cached_tokens == 0, "first joined with nothing cached"
    tally = cache.take_tally()
    assert tally.requests == 2 and tally.hits == 0
    assert tally.preempted_requests == young.preemptions and tally.preempted_hits == 16 * young.preemptions
    assert batch.kv_used_tokens == 0
