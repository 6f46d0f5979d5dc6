"""FrontDoor: a model replica's core, the one object every door calls.

A door (HTTP: :mod:`serve_app.front_door.http_api`; gRPC: :mod:`serve_app.front_door.grpc_api`)
turns its protocol into three calls and turns their results back into its protocol:

1. :meth:`FrontDoor.arrive`: the request's permit, with a place of the replica, before its body is
   read (429 ``overloaded`` when the replica holds all it may);
2. :meth:`FrontDoor.admit`: the body's rules (:mod:`serve_app.front_door.admission.pipeline`),
   which add the key's lease and the places of every engine sequence to the permit;
3. :meth:`FrontDoor.generate`: the answer (:class:`~serve_app.front_door.core.generation.Generation`),
   which closes the permit when it ends.

An answer that goes on without its request (a background response, a stored gRPC answer) is
handed the permit (:meth:`~serve_app.front_door.core.permit.Permit.hand_over`) by
:class:`~serve_app.front_door.core.background.BackgroundAnswers`, or, past its key's cap, waits
for one (:meth:`FrontDoor.permit_now`). The core also keeps what the replica's autoscaling reads:
the answers it runs and queues (:meth:`FrontDoor.answers`).

Runs in each model replica.
"""

from __future__ import annotations

from typing import Any

from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.capacity import GenerationSlots, SlotHold
from serve_app.front_door.admission.deadlines import Deadline
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.admission.models import ModelCatalog
from serve_app.front_door.admission.open_calls import OpenCalls
from serve_app.front_door.admission.pipeline import Admitted, BodyRules, Expand, admit
from serve_app.front_door.admission.request_body import RequestBody
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.core.generation import ErrorEvent, Generation, chat_error_event
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.core.stream_watch import StallWatch
from serve_app.front_door.telemetry.record import Observer, RequestObserver, RequestRecord
from serve_app.front_door.telemetry.request_log import log_request
from serve_app.protocol import with_priority


class FrontDoor:
    """A model replica's core (see the module's docstring). ``slots``: the replica's generation places
    (None: unbounded); ``metrics``: told of every request as it moves and ends; ``background``: the
    ``stored``: the answer log and the answers this replica generates detached (None: nothing is stored)."""

    def __init__(
        self,
        rules: BodyRules,
        api_keys: APIKeys | None = None,
        slots: GenerationSlots | None = None,
        metrics: RequestObserver | None = None,
        stored: StoredResponses | None = None,
    ) -> None:
        self.rules = rules
        self.api_keys = api_keys
        self.slots = slots
        self.metrics = metrics
        self.stored = stored
        self.open_calls = OpenCalls(rules.settings.open_calls)
        self.stall_watch = StallWatch(rules.settings.stream_stall_timeout_s)  # every stream of this replica
        self._permits = 0  # permits not closed: the requests and answers under way here
        if stored is not None:
            stored.background.permits = self.permit_now

    @property
    def settings(self) -> IngressSettings:
        return self.rules.settings

    @property
    def models(self) -> ModelCatalog[Any]:
        return self.rules.models

    def observers(self) -> list[Observer]:
        """Who is told of each request once it has ended: the metrics, then the log line."""
        observers: list[Observer] = [self.metrics.ended] if self.metrics is not None else []
        return observers + ([log_request] if self.settings.log_requests else [])

    def new_record(self, endpoint: str, **fields: Any) -> RequestRecord:
        """A record for a request the core observes (phases told to the metrics, content kept if logged)."""
        on_phase = self.metrics.moved if self.metrics is not None else None
        return RequestRecord(endpoint, on_phase=on_phase, log_content=self.settings.log_content, **fields)

    def arrive(self, record: RequestRecord | None, key_id: str | None) -> Permit:
        """A request's permit, holding one place of the replica from its arrival (429 when none is
        free; ``record``'s model and error then say so)."""
        places = None
        if self.slots is not None:
            places = SlotHold(self.slots, key_id, self.slots.take(record, key_id))
        return self._permit(key_id, places)

    async def admit(
        self,
        permit: Permit,
        body: RequestBody,
        endpoint: Endpoint,
        record: RequestRecord,
        expand: Expand | None = None,
    ) -> Admitted:
        """The body's rules; the key's lease and the sequences' places go into ``permit`` (closed by
        whoever holds it, whatever the outcome)."""
        return await admit(self.rules, body, endpoint, record, permit, expand)

    def generate(
        self,
        permit: Permit,
        admitted: Admitted,
        method: str,
        deadline: Deadline,
        record: RequestRecord,
        error_event: ErrorEvent = chat_error_event,
    ) -> Generation:
        """The admitted request's answer, under ``permit`` (closed when the answer ends). Its engine
        priority is its fair-share rank on this replica, taken when its places were."""
        payload = with_priority(admitted.payload, permit.rank) if permit.places is not None else admitted.payload
        return Generation(
            admitted.entry.model,
            method,
            payload,
            deadline,
            record,
            permit,
            self.settings.unavailable_retry_s,
            error_event,
            self.stall_watch,
        )

    async def permit_now(self, key_id: str | None, sequences: int) -> Permit:
        """A permit for an answer that waited (a background answer past its key's cap): the replica's
        places for its ``sequences`` and its key's lease, or the 429 of whichever is not free now."""
        places = None
        if self.slots is not None:
            places = SlotHold(self.slots, key_id, self.slots.take(None, key_id, sequences), sequences)
        permit = self._permit(key_id, places)
        limits = self.rules.key_limits
        try:
            if limits is not None and key_id is not None:
                permit.lease = await limits.admit(key_id)
        except BaseException:
            permit.on_close = None  # (nothing ran under it: the answers waiting are not told of it)
            permit.close()
            self._permits -= 1
            raise
        return permit

    def answers(self) -> int:
        """The answers this replica runs or queues (what its autoscaling counts): every permit not
        closed (a request from its arrival, a background answer while it runs) and every background
        answer waiting for its places. A Stream call counts the requests on it, not itself."""
        waiting = self.stored.background.waiting if self.stored is not None else 0
        return self._permits + waiting

    def _permit(self, key_id: str | None, places: SlotHold | None) -> Permit:
        self._permits += 1
        return Permit(key_id, places, limits=self.rules.key_limits, on_close=self._permit_closed)

    def _permit_closed(self) -> None:
        self._permits -= 1
        if self.stored is not None:
            self.stored.background.places_freed()
