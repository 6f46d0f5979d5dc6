"""What a response store keeps, and the contract the in-process and the Redis store both meet.

A stored response is its response object as last known (``queued``, ``in_progress``, then
final), the API key that made it, and the input items its answer followed (for a later
``previous_response_id``). A background answer also has an event log: its SSE events, each
appended under its ``sequence_number`` (a number is taken once: a second append of it fails),
read from any number after, and a lease its producing replica renews while it generates.

Each owner's responses are bounded in count and in bytes (its objects, input items and events):
past either bound its own oldest go, never one being generated, never another owner's.

A response's status only moves forward: ``queued``, ``in_progress``, then one final status that
never changes again (an update that would go back, or replace a final status, is refused). A
log's appends are conditional: on the answer still being stored, and on its number being the
next (a number is taken once: a second append of another event under it is refused; the same
event appended again, as a retried call does, is not a second event).

Runs in each model replica.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.errors import APIError

# A log's last event: the answer's end (whatever it was) or an error event; "grpc.final" is a kept
# gRPC answer's final response (serve_app.front_door.grpc_api.stored_answers).
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", "error", "grpc.final")
FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
STATUS_ORDER = {"queued": 0, "in_progress": 1} | dict.fromkeys(FINAL_STATUSES, 2)  # how far an answer got
NO_OWNER = ""  # the owner of every response where no API keys are configured


class StoreDown(APIError):
    """The store did not answer (its calls retried); 503 to a request that needed it."""


def store_down(reason: object) -> StoreDown:
    return StoreDown(
        503,
        f"the response store does not answer ({reason}); retry shortly",
        code="store_unavailable",
        headers={"Retry-After": "5"},
    )


def store_full() -> StoreDown:
    """Redis is at its ``maxmemory`` (it evicts nothing: docs/operations.md sizes it from the bounds)."""
    return StoreDown(
        503,
        "the response store is full; retry once its responses expire",
        code="store_full",
        headers={"Retry-After": "60"},
    )


def too_large(size: int, bound: int) -> APIError:
    """A response that would be past its key's byte bound on its own, before it has an answer."""
    return APIError(
        413,
        f"this response and its input are {size} bytes, more than the store keeps for one API key "
        f"(ingress.responses_store.max_bytes_per_key: {bound})",
        code="response_too_large",
    )


def moves_forward(current: str | None, new: str | None) -> bool:
    """Whether a response whose status is ``current`` may take ``new`` (never back, never from a final one)."""
    now, then = STATUS_ORDER.get(str(current), 0), STATUS_ORDER.get(str(new), 0)
    return now < 2 and then >= now


@dataclass(frozen=True)
class StoredResponse:
    """A stored response as a reader gets it: the object, its owner, and whether it has an event log."""

    response: dict[str, Any]
    owner: str
    background: bool

    @property
    def status(self) -> str:
        return str(self.response.get("status"))

    @property
    def finished(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def is_response(self) -> bool:
        """A Responses API response (not a gRPC kept answer, which shares the store)."""
        return self.response.get("object") == "response"


class ResponseStore(Protocol):
    """Where stored responses and event logs live (:mod:`.memory_store`, :mod:`.redis_store`)."""

    @property
    def where(self) -> str:
        """Where answers live, for the replica's log and ``make serve``'s ready line."""
        ...

    async def save(
        self, response_id: str, owner: str, response: dict[str, Any], input_items: list[Any], background: bool
    ) -> None:
        """Keep a new response, the owner's oldest removed past the owner's bounds (413
        ``response_too_large``: it is past the byte bound on its own)."""
        ...

    async def update(self, response_id: str, response: dict[str, Any]) -> bool:
        """Replace a kept response's object, its status moved on (False, nothing changed: it is not
        kept, or its status is final or further on than the new one's)."""
        ...

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it is kept and ``owner``'s (None otherwise: another key's is not there for it)."""
        ...

    async def input_items(self, response_id: str) -> list[Any]:
        """The input items a kept response's answer followed."""
        ...

    async def exists(self, response_id: str) -> bool: ...

    async def delete(self, response_id: str) -> None: ...

    async def append(self, response_id: str, sequence_number: int, event: str) -> bool:
        """Add an event to the response's log under ``sequence_number``; False if that number is
        another event's or the response is no longer kept."""
        ...

    async def read(self, response_id: str, after: int, wait_s: float) -> list[tuple[int, str]]:
        """The log's events after ``after`` (-1: all), waiting up to ``wait_s`` for one if there are none yet."""
        ...

    async def renew_lease(self, response_ids: list[str], lease_s: float) -> None:
        """The producing replica is alive: its answers' leases run ``lease_s`` more, and the answers
        are kept ``ttl_s`` from now (an answer being generated never expires, however long it waits)."""
        ...

    async def leased(self, response_id: str) -> bool:
        """Whether the answer's producer renewed its lease within the lease time."""
        ...

    async def request_cancel(self, response_id: str) -> None:
        """Ask whichever replica generates the answer to stop it."""
        ...

    def cancel_requests(self) -> AsyncIterator[str]:
        """The ids of answers whose cancel was asked, as each is asked, for as long as it is read."""
        ...

    async def close(self) -> None: ...


def event_type(event: str) -> str:
    """The type of an SSE event framed as ``event: <type>\\ndata: ...``."""
    return event[len("event: ") : event.index("\n")] if event.startswith("event: ") else ""


def is_terminal(event: str) -> bool:
    return event_type(event) in TERMINAL_EVENTS


def split_events(chunk: str) -> list[str]:
    """A chunk of SSE text (one or several events, as the engine's stream coalesces them), event by event."""
    return [part + "\n\n" for part in chunk.split("\n\n") if part]


def event_response(event: str) -> dict[str, Any] | None:
    """The response object a ``response.*`` event carries, if it carries one."""
    _, _, data = event.partition("\ndata: ")
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    response = parsed.get("response") if isinstance(parsed, dict) else None
    return response if isinstance(response, dict) else None
