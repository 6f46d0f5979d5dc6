"""The prefix-affinity rule: which model replica a prompt should go to, and what the router remembers.

Pure logic, tested without Ray; :mod:`serve_app.prefix_routing.router` applies it inside
Serve's request router. A prompt is cut into blocks of ``block_chars`` characters, each
named by a hash chained over every block before it, so a block's hash names the whole
prefix that ends with it (vLLM names its KV-cache blocks the same way, by token).
:class:`PrefixTable` remembers, for the most recently used blocks, which replicas were sent
a prompt that began with them. :func:`choose` prefers, in order:

1. the least busy replica that was sent this prompt's longest known prefix, when that
   prefix reaches past the conversation's opening (so it is this conversation's own
   history, or a prompt seen before whole);
2. else the conversation's *home*: a replica picked from the opening alone by rendezvous
   hashing, so every ingress replica (each has its own table) sends a conversation's first
   turn, and any later turn it has not seen, to the same replica;

and drops the preference when that replica runs more than ``max_load_gap`` requests beyond
the least busy one: load first, so one hot prefix cannot pile every request on one replica.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


class Decision(str, enum.Enum):
    """How a request's replica was chosen (the ``decision`` label of the router's counter)."""

    AFFINITY = "affinity"  # a replica that was sent this prompt's prefix, beyond its opening
    HOME = "home"  # the conversation's home replica (by its opening)
    FALLBACK = "fallback"  # the preferred replica was too busy (or refused it): chosen by load
    BY_LOAD = "by_load"  # nothing to prefer (no prompt text): chosen by load


def prefix_blocks(text: str, block_chars: int) -> tuple[int, ...]:
    """Chained hashes of ``text``'s full blocks: the i-th names ``text[: (i + 1) * block_chars]``.

    Python's ``hash`` is salted per process; the table lives in one process, so that is enough.
    """
    blocks = []
    previous = 0
    for end in range(block_chars, len(text) + 1, block_chars):
        previous = hash((previous, text[end - block_chars : end]))
        blocks.append(previous)
    return tuple(blocks)


def opening_digest(opening: str) -> bytes:
    """A digest of a conversation's opening that every process computes alike."""
    return hashlib.blake2b(opening.encode(), digest_size=16).digest()


def home_replica(home: bytes, replicas: Iterable[str]) -> str:
    """The replica rendezvous hashing gives ``home``: the same in every process, and when a
    replica leaves or joins only the conversations whose home it was (or becomes) move."""
    return max(replicas, key=lambda replica: hashlib.blake2b(home + replica.encode(), digest_size=8).digest())


@dataclass(frozen=True)
class RoutingKey:
    """What the router reads of one request's prompt."""

    blocks: tuple[int, ...]  # prefix_blocks of the rendered prompt
    home: bytes  # opening_digest of its opening
    opening_blocks: int  # how many whole blocks the opening spans


@dataclass(frozen=True)
class Choice:
    """The replica :func:`choose` prefers (None: let load decide) and why."""

    replica: str | None
    decision: Decision
    matched_blocks: int = 0


class PrefixTable:
    """Which replicas were sent which prefix blocks, for at most ``max_blocks`` blocks.

    Least recently used blocks are forgotten first; a prompt's blocks are touched from its
    end to its start, so a shared start (a system prompt) outlives the histories after it.
    """

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, blocks: tuple[int, ...], replica: str) -> None:
        """``replica`` was sent a prompt made of ``blocks``."""
        holders = self._holders
        for block in reversed(blocks):
            held_by = holders.get(block, ())
            if replica not in held_by:
                holders[block] = (*held_by, replica)
            holders.move_to_end(block)
        while len(holders) > self.max_blocks:
            holders.popitem(last=False)

    def longest_match(self, blocks: tuple[int, ...], among: Collection[str]) -> tuple[int, tuple[str, ...]]:
        """How many leading ``blocks`` some of ``among`` were sent, and which of them."""
        for depth in range(len(blocks), 0, -1):
            held_by = self._holders.get(blocks[depth - 1])
            if held_by:
                present = tuple(replica for replica in held_by if replica in among)
                if present:
                    return depth, present
        return 0, ()

    def forget(self, replica: str) -> None:
        """Drop ``replica`` (it left the deployment) from every block."""
        for block, held_by in list(self._holders.items()):
            if replica in held_by:
                rest = tuple(r for r in held_by if r != replica)
                if rest:
                    self._holders[block] = rest
                else:
                    del self._holders[block]


def choose(key: RoutingKey, table: PrefixTable, loads: Mapping[str, int], max_load_gap: int) -> Choice:
    """The replica for ``key`` among ``loads`` (replica -> requests it runs), or None for load to decide."""
    if not loads:
        return Choice(None, Decision.BY_LOAD)
    depth, holders = table.longest_match(key.blocks, loads.keys())
    if depth and depth >= key.opening_blocks:
        preferred, decision = min(holders, key=loads.__getitem__), Decision.AFFINITY
    else:
        preferred, decision = home_replica(key.home, loads), Decision.HOME
    if loads[preferred] - min(loads.values()) > max_load_gap:
        return Choice(None, Decision.FALLBACK, depth)
    return Choice(preferred, decision, depth)
