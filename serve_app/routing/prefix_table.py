"""The prefix-affinity rule: which model replica a prompt should go to, and what the router remembers.

Pure logic, tested without Ray; :mod:`serve_app.routing.prefix_router` applies it inside
Serve's request router. A prompt is cut into blocks of ``block_chars`` characters, each
named by a hash chained over every block before it, so a block's hash names the whole
prefix that ends with it (vLLM names its KV-cache blocks the same way, by token).
:class:`PrefixTable` remembers, for the most recently used blocks, which replicas were sent
a prompt that began with them. :func:`choose` prefers, in order:

1. the least busy replica that was sent this prompt's longest known prefix, when that
   prefix reaches past the conversation's opening (so it is this conversation's own
   history, or a prompt seen before whole);
2. else the conversation's *home*: the replica rendezvous hashing picks from the opening
   alone, whatever the loads, so every process the router runs in (each has its own table: the
   pickers of every node, two a node) sends a conversation's first turn, and any later turn it
   has not seen, to the same replica. (A home bounded by the loads each process saw spread a
   burst of new conversations more evenly, but two pickers then sent a conversation's turns to
   different replicas: decision record 26.)

and drops the preference (load decides) when that replica runs more than ``max_load_gap``
requests beyond the least busy one, or when it already runs a copy of the very same prompt (the
whole text) and another replica is less busy, unless the prompt carries history that replica
holds. The first bounds how much affinity may unbalance the replicas; the second keeps one hot
prompt (many conversations that start alike) from piling on one replica at any load: the prompt
is computed once more on a less busy replica, which is then remembered as holding it too, and
later copies go to the least busy of its holders. A conversation's later turn is not a copy: it
stays with its history, also while a sibling that started alike runs there, or its own previous
turn, whose end the router may not have been told of yet (with direct streaming it never is):
its blocks may match the previous turn's whole, when the turn adds less than a block, but its
text differs.

Runs in each ReplicaPicker replica, inside the router.
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
    SPREAD = "spread"  # the preferred replica runs a copy of this prompt already and another is less busy: by load
    BY_LOAD = "by_load"  # nothing to prefer (no prompt text): chosen by load


def prefix_blocks(text: str, block_chars: int, salt: str | None = None) -> tuple[int, ...]:
    """Chained hashes of ``text``'s full blocks: the i-th names ``text[: (i + 1) * block_chars]``
    (and ``salt``, the request's ``cache_salt``: as in vLLM's cache, prompts of different salts share no block).

    Python's ``hash`` is salted per process; the table lives in one process, so that is enough.
    """
    blocks = []
    previous = 0 if salt is None else hash(("cache_salt", salt))
    for end in range(block_chars, len(text) + 1, block_chars):
        previous = hash((previous, text[end - block_chars : end]))
        blocks.append(previous)
    return tuple(blocks)


def opening_digest(opening: str, salt: str | None = None) -> bytes:
    """A digest of a conversation's opening (under the request's ``cache_salt``) that every process computes alike."""
    data = opening.encode() if salt is None else salt.encode() + b"\0" + opening.encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def home_replica(home: bytes, replicas: Iterable[str]) -> str:
    """The replica rendezvous hashing gives ``home``: the same in every process, whatever the
    loads, and when a replica leaves or joins only the conversations it heads (or comes to
    head) move."""
    return max(replicas, key=lambda replica: hashlib.blake2b(home + replica.encode(), digest_size=8).digest())


@dataclass(frozen=True)
class RoutingKey:
    """What the router reads of one request's prompt."""

    blocks: tuple[int, ...]  # prefix_blocks of the rendered prompt
    home: bytes  # opening_digest of its opening
    opening_blocks: int  # how many whole blocks the opening spans
    # opening_digest of the whole prompt: what makes two requests copies of one prompt (a later
    # turn may add less than a block to the one before it, and its blocks then match it whole)
    whole: bytes


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


def choose(
    key: RoutingKey,
    table: PrefixTable,
    loads: Mapping[str, int],
    max_load_gap: int,
    running_same_prompt: Collection[str] = (),
) -> Choice:
    """The replica for ``key`` among ``loads`` (replica -> requests it runs), or None for load to decide.

    ``running_same_prompt``: the replicas running a copy of this very prompt now.
    """
    if not loads:
        return Choice(None, Decision.BY_LOAD)
    depth, holders = table.longest_match(key.blocks, loads.keys())
    if depth and depth >= key.opening_blocks:
        preferred, decision = min(holders, key=loads.__getitem__), Decision.AFFINITY
    else:
        preferred, decision = home_replica(key.home, loads), Decision.HOME
    least = min(loads.values())
    if loads[preferred] - least > max_load_gap:
        return Choice(None, Decision.FALLBACK, depth)
    # A copy of a prompt seen whole, or a conversation's start, spreads; history stays where it is.
    copy_or_start = decision is Decision.HOME or depth == len(key.blocks)
    if copy_or_start and preferred in running_same_prompt and loads[preferred] > least:
        return Choice(None, Decision.SPREAD, depth)
    return Choice(preferred, decision, depth)


class RunningPrompts:
    """Which replicas run a copy of which prompt now (the requests this router sent), by ``RoutingKey.whole``."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests  # (a request whose end is never reported is dropped)
        self._requests: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._count: dict[tuple[str, bytes], int] = {}

    def started(self, request_id: str, replica: str, home: bytes) -> None:
        self._requests[request_id] = (replica, home)
        self._count[replica, home] = self._count.get((replica, home), 0) + 1
        while len(self._requests) > self.max_requests:
            self.ended(next(iter(self._requests)))

    def ended(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        left = self._count[entry] - 1
        if left:
            self._count[entry] = left
        else:
            del self._count[entry]

    def replicas(self, home: bytes, among: Iterable[str]) -> set[str]:
        return {replica for replica in among if (replica, home) in self._count}

    def forget(self, replica: str) -> None:
        for request_id, (held_by, _) in list(self._requests.items()):
            if held_by == replica:
                self.ended(request_id)
