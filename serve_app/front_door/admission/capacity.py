"""GenerationSlots: a model replica refuses what it cannot queue, with OpenAI's 429. Runs in the model replica.

A request is at its replica as soon as HAProxy forwards it, and Serve's own limit there
would hold ``/health`` behind generation and answer past its queue with a plain-text
status. So the replica's Serve limit is raised past what it generates (see
:func:`serve_app.deployments.options.model_server_options`), and the replica keeps
the count Serve would keep: generation requests in this replica, HTTP and gRPC together,
at most ``limit`` (the configured ``max_ongoing_requests`` plus ``max_queued_requests``);
past it, 429 ``overloaded`` (gRPC: ``RESOURCE_EXHAUSTED``). Requests over the engine's
batch wait in vLLM's own queue.

A place is an engine sequence: a request takes one as it arrives, before its body is
read, and once its body says it starts more (a /v1/completions prompt list times ``n``),
as many as it starts (:class:`SlotHold`), or 429 if they are not free. So a request of
8 sequences counts as 8 of a 64-sequence batch, where Serve counted it as one.

With ``ingress.fair_share`` the count is kept per API key too (:class:`FairShare`), so
that one key's flood cannot make another key wait behind it or be refused with it:

- each request gets as its engine priority its key's rank here, how many requests its key
  already holds on this replica, and vLLM's priority scheduling serves waiting requests by
  rank (then by arrival): a key holding fewer requests goes ahead of one holding more, so
  a key sending one request at a time waits about one slot's turnover, whatever another
  key holds;
- the last places (``reserved``) go only to keys holding fewer than their part of them, so a
  key with nothing here still finds a place when another key has filled the rest; a key
  refused for that gets 429 ``fair_share_exceeded`` with ``Retry-After``.

A request's rank is never below a rank its key's requests still hold (:class:`KeyRanks`), so a
key's requests are served in the order they came: a waiting request is passed only by other
keys' requests of lower rank, which come from keys holding fewer requests than it ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from serve_app.errors import APIError, overloaded
from serve_app.front_door.telemetry.record import RequestRecord


@dataclass(frozen=True)
class FairShare:
    """The rule for the last places of a replica: pure arithmetic, see the module's docstring.

    ``reserved`` places of ``limit`` are held back: once only those are free, a key takes one only
    while it holds fewer than ``reserved / (other keys holding places + 1)``.
    """

    limit: int
    reserved: int

    @classmethod
    def for_replica(cls, limit: int, runs_at_once: int) -> FairShare:
        """Keep one batch's worth of places (``runs_at_once``), at most half of those that wait."""
        return cls(limit, max(0, min(runs_at_once, (limit - runs_at_once) // 2)))

    def allowance(self, other_keys: int) -> int:
        """How many places a key may hold and still take a reserved one, with ``other_keys`` holding places."""
        return max(1, self.reserved // (other_keys + 1))

    def admits(self, held: int, key_held: int, other_keys: int, places: int = 1) -> bool:
        """Whether a key holding ``key_held`` of the replica's ``held`` places may take ``places`` more
        (``held + places`` at most ``limit``: a full replica refuses everyone)."""
        return self.limit - held - places >= self.reserved or key_held + places <= self.allowance(other_keys)


class KeyRanks:
    """Each API key's places held here, and the ranks its requests hold.

    A request's rank is the places its key holds when it comes, but never below a rank its
    key's requests still hold. A key's count falls as its older requests end while others of
    them still wait; ranked by the count alone, its newer requests would pass those, and under
    a steady flood its oldest could wait on. So a key's requests keep the order they came in,
    and while a key holds a request ranked r, it counts as holding at least r.
    """

    def __init__(self) -> None:
        self.held: Counter[str] = Counter()  # places, by key
        self._ranks: dict[str, Counter[int]] = {}  # requests held, by rank, by key

    def take(self, key_id: str, places: int = 1) -> int:
        """A request of ``key_id`` holding ``places``: its rank."""
        ranks = self._ranks.setdefault(key_id, Counter())
        rank = max(self.held[key_id], max(ranks, default=0))
        self.held[key_id] += places
        ranks[rank] += 1
        return rank

    def grow(self, key_id: str, places: int) -> None:
        """A request already ranked holds ``places`` more."""
        self.held[key_id] += places

    def give_back(self, key_id: str, rank: int, places: int) -> None:
        """A request of ``key_id`` ranked ``rank`` ended, holding ``places``."""
        self.held[key_id] -= places
        ranks = self._ranks[key_id]
        ranks[rank] -= 1
        if not ranks[rank]:
            del ranks[rank]
        if not self.held[key_id]:
            del self.held[key_id], self._ranks[key_id]


class GenerationSlots:
    """The generation requests one replica holds, whichever front door took them: at most ``limit``.

    ``model`` is the model the replica serves: a request it refuses is counted against that
    model (its metrics' ``model`` label), though its body was never read. With ``fair_share``,
    places are also counted per API key.
    """

    def __init__(self, limit: int, model: str | None = None, fair_share: FairShare | None = None) -> None:
        self.limit = limit
        self.model = model
        self.fair_share = fair_share
        self.held = 0
        self.keys = KeyRanks()

    @property
    def by_key(self) -> Counter[str]:
        """Places held, by API key (with fair share)."""
        return self.keys.held

    def take(self, record: RequestRecord | None = None, key_id: str | None = None, places: int = 1) -> int:
        """Take ``places`` for a request of ``key_id``; return its rank (:class:`KeyRanks`; 0 without
        fair share or a key). Raises the 429 ``overloaded`` APIError when they are not free,
        ``fair_share_exceeded`` when only reserved places are and the key holds its part, with
        ``record`` (the request's) counted against this replica's model."""
        self._check_free(record, key_id, places)
        self.held += places
        if self.fair_share is None or key_id is None:
            return 0
        return self.keys.take(key_id, places)

    def grow(self, record: RequestRecord | None, key_id: str | None, places: int) -> None:
        """``places`` more for a request already holding some (429 as :meth:`take`)."""
        self._check_free(record, key_id, places)
        self.held += places
        if self.fair_share is not None and key_id is not None:
            self.keys.grow(key_id, places)

    def give_back(self, key_id: str | None = None, places: int = 1, rank: int = 0) -> None:
        self.held -= places
        if self.fair_share is not None and key_id is not None:
            self.keys.give_back(key_id, rank, places)

    def _check_free(self, record: RequestRecord | None, key_id: str | None, places: int) -> None:
        refusal = self._refusal(key_id, places)
        if refusal is not None:
            if record is not None:
                record.model = record.model or self.model
                record.error_code = refusal.code  # (the request log's and metrics' error)
            raise refusal

    def _refusal(self, key_id: str | None, places: int) -> APIError | None:
        if self.held + places > self.limit:
            return overloaded()
        if self.fair_share is None or key_id is None:
            return None
        key_held = self.by_key.get(key_id, 0)
        others = len(self.by_key) - (1 if key_held else 0)
        if self.fair_share.admits(self.held, key_held, others, places):
            return None
        return fair_share_exceeded(
            f"this replica is nearly full and this API key holds {key_held} of its engine sequences"
        )

    @contextmanager
    def hold(self, record: RequestRecord | None = None, key_id: str | None = None) -> Iterator[SlotHold]:
        """One place held while the block runs, and any more the request grows to; given back after."""
        hold = SlotHold(self, key_id, self.take(record, key_id))
        try:
            yield hold
        finally:
            hold.give_back()


@dataclass
class SlotHold:
    """The places one request holds: one from its arrival, as many as its engine sequences once
    its body is read (:meth:`grow_to`); its rank is fixed at arrival."""

    slots: GenerationSlots
    key_id: str | None
    rank: int
    places: int = 1

    def grow_to(self, places: int, record: RequestRecord | None = None) -> None:
        """Hold ``places`` in all: the request's engine sequences (429 as :meth:`GenerationSlots.take`)."""
        if places > self.places:
            self.slots.grow(record, self.key_id, places - self.places)
            self.places = places

    def give_back(self) -> None:
        if self.places:
            self.slots.give_back(self.key_id, self.places, self.rank)
            self.places = 0


def fair_share_exceeded(why: str) -> APIError:
    return APIError(
        429,
        f"{why}, its share while others wait; retry shortly",
        code="fair_share_exceeded",
        headers={"Retry-After": "1"},
    )
