"""vLLM's automatic prefix caching, as the simulated engine's scheduler sees it.

vLLM names each full KV block of a prompt by a hash chained over the blocks
before it, keeps computed blocks after their request ends, and gives a new
request the longest run of its leading blocks that is still there; those tokens
are not prefilled again. At most ``prompt - 1`` tokens hit, so the last token is
always computed (it yields the first output). Blocks are evicted least recently
used when the cache needs room.

Simplified here: the cache holds up to the KV cache's size in blocks whatever
the running sequences use, and only prompt blocks are cached (the simulated
answers are random tokens, which the next turn's prompt would not tokenize back
to). Pure logic, tested without vLLM.

Runs in each model replica with a simulated engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def block_hashes(token_ids: Sequence[int], block_tokens: int, cache_salt: str | None = None) -> tuple[int, ...]:
    """A name for each full block of ``token_ids`` that depends on every token before it, and on
    the request's ``cache_salt`` (vLLM hashes it into the first block: different salts, no block shared)."""
    hashes: list[int] = []
    previous = 0 if cache_salt is None else hash(("cache_salt", cache_salt))
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        previous = hash((previous, tuple(token_ids[start : start + block_tokens])))
        hashes.append(previous)
    return tuple(hashes)


@dataclass
class LookupTally:
    """vLLM's ``PrefixCacheStats`` counts: lookups of new requests, and of preempted ones apart."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of them found cached
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class PrefixCache:
    """Cached KV blocks by hash, least recently used first."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        if block_tokens < 1 or capacity_blocks < 1:
            raise ValueError("a prefix cache needs a block size and room for a block")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self.tally = LookupTally()
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hit_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Tokens of a prompt the cache holds: its leading cached blocks, short of its last token."""
        most = (prompt_tokens - 1) // self.block_tokens
        hit = 0
        while hit < min(most, len(hashes)) and hashes[hit] in self._blocks:
            hit += 1
        return hit * self.block_tokens

    def admit(self, hashes: Sequence[int], prompt_tokens: int, preempted: bool) -> int:
        """A request starts computing: its hit (counted, as vLLM counts at admission) and its blocks used."""
        hit = self.hit_tokens(hashes, prompt_tokens)
        tally = self.tally
        if preempted:
            tally.preempted_requests += 1
            tally.preempted_queries += prompt_tokens
            tally.preempted_hits += hit
        else:
            tally.requests += 1
            tally.queries += prompt_tokens
            tally.hits += hit
        for block in hashes[: hit // self.block_tokens]:
            self._blocks.move_to_end(block)
        return hit

    def insert(self, hashes: Sequence[int]) -> None:
        """Blocks just computed are cached (the least recently used go when there is no room)."""
        for block in hashes:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def take_tally(self) -> LookupTally:
        """The counts since the last call (vLLM reports them with each step's stats)."""
        tally, self.tally = self.tally, LookupTally()
        return tally

    def clear(self) -> None:
        """vLLM's ``reset_prefix_cache``."""
        self._blocks.clear()
