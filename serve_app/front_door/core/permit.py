"""Permit: what one request holds from its arrival until its answer ends, given back exactly once.

A request takes a place of its replica as it arrives (:meth:`~.front_door.FrontDoor.arrive`),
more once its body says how many engine sequences it starts, and its key's place among the
key's requests at once (a lease at the RateLimiter, renewed while held) once its key's limits
admit it (:mod:`serve_app.front_door.admission.pipeline`). Its tokens are charged to its key as
they are made. The permit holds all of it and :meth:`Permit.close` gives it all back: the door
that admitted a request closes its permit when the request ends, and an answer generated
detached from its request (a background answer, a stored gRPC answer) takes the permit over
(:meth:`Permit.hand_over`) and closes it when the answer ends. So whatever a key starts counts
against it for as long as it runs, wherever it runs, as TGI's permit does.

Runs in each model replica.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from serve_app.front_door.admission.capacity import SlotHold
from serve_app.front_door.admission.rate_limits import KeyLease, KeyLimits


@dataclass(eq=False)
class Permit:
    """The places one request holds (see the module's docstring)."""

    key_id: str | None
    places: SlotHold | None = None  # the replica's places (None: the replica counts none)
    lease: KeyLease | None = None  # the key's place at the limiter (None: no concurrency limit)
    limits: KeyLimits | None = None  # the key's limits: where the lease goes back and tokens are charged
    on_close: Callable[[], None] | None = None  # told once the places are free again (waiting answers)
    answer_end: Callable[[], None] | None = None  # its answer's own end (Generation's): aborts what still runs
    charged: int = 0  # tokens charged so far
    closed: bool = False

    @property
    def rank(self) -> int:
        """The request's fair-share rank on this replica: its engine priority."""
        return self.places.rank if self.places is not None else 0

    @property
    def counts_tokens(self) -> bool:
        return self.limits is not None and self.limits.counts_tokens and self.key_id is not None

    def charge(self, tokens: int) -> None:
        """Charge ``tokens`` made so far to the key (its token rate)."""
        if tokens > 0 and self.counts_tokens:
            assert self.limits is not None and self.key_id is not None
            self.limits.charge(self.key_id, tokens)
            self.charged += tokens

    def settle(self, total: int) -> None:
        """The answer used ``total`` tokens in all: charge what was not charged yet."""
        self.charge(total - self.charged)

    def hand_over(self) -> Permit:
        """A permit holding what this one holds; this one then holds nothing (its close is a no-op).
        For an answer that outlives the request that admitted it."""
        taken = Permit(self.key_id, self.places, self.lease, self.limits, self.on_close, self.answer_end, self.charged)
        self.places, self.lease, self.closed = None, None, True
        return taken

    def close(self) -> None:
        """Give back every place held, and end the answer if it still runs; a no-op after the first call."""
        if self.closed:
            return
        self.closed = True
        if self.answer_end is not None:
            self.answer_end()  # (an answer whose stream its door never read is aborted too)
        places, lease, self.places, self.lease = self.places, self.lease, None, None
        if places is not None:
            places.give_back()
        if lease is not None and self.limits is not None:
            self.limits.ended(lease)
        if self.on_close is not None:
            self.on_close()
