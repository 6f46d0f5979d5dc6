"""Reading an answer's log as it grows, and ending an answer no producer will end.

:func:`follow` yields an answer's events after a position, those logged and then each as it is
logged, to the last. A reader that finds the log quiet and the producer's lease lapsed (its
replica died) ends the answer: a ``failed`` response and an ``error`` event, written once
whoever writes it first (a sequence number is taken once). A lease is believed lapsed once it
stayed so for :data:`LAPSE_GRACE_S`: after a store outage (a Sentinel failover can outlast a
lease) the producer's replica renews its leases within that. :func:`finish` is how every writer
ends a log.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from serve_app.errors import responses_error_event
from serve_app.front_door.answer_log.store import ResponseStore, StoreDown, StoredResponse, is_terminal

Failure = tuple[int, str, str | None]  # an answer's end in error: status, message, code

# The longest a reader waits on a quiet log before asking whether its answer is still stored.
QUIET_S = 1.0
# How long a lease must stay lapsed before its answer is ended (its replica's renewals retry this often
# twice over, serve_app.front_door.core.background.RENEW_RETRY_S).
LAPSE_GRACE_S = 2.0

CANCELLED: Failure = (499, "the response was cancelled", "response_cancelled")
REPLICA_LOST: Failure = (
    503,
    "the replica generating this response stopped before it ended; send the request again",
    "replica_lost",
)
REPLICA_STOPPED: Failure = (
    503,
    "the replica that took this response stopped before it began; send the request again",
    "replica_stopped",
)


async def finish(
    store: ResponseStore,
    response: dict[str, Any],
    written: int,
    final: dict[str, Any] | None,
    failure: Failure | None,
    error_logged: bool = False,
) -> bool:
    """End an answer's log and keep its last object: ``final`` (the answer's own end) or, on a
    ``failure``, an error event (unless ``error_logged``: the answer's own stream logged it) and a
    ``failed`` (``cancelled``) object. False when another writer ended it first."""
    if final is not None and failure is None:
        return await store.update(str(response["id"]), final)
    status, message, code = failure or (500, "the answer ended without its final event", "internal_error")
    if not error_logged:
        event = responses_error_event(status, message, code, written).decode()
        if not await store.append(str(response["id"]), written, event):
            return False
    ended = "cancelled" if (status, message, code) == CANCELLED else "failed"
    error = {"code": code, "message": message}
    return await store.update(str(response["id"]), response | {"status": ended, "error": error})


async def end_if_orphaned(store: ResponseStore, found: StoredResponse) -> StoredResponse:
    """A background answer whose producer's lease lapsed (its replica died) ended here, ``failed``
    with :data:`REPLICA_LOST`, as a reader would end it; the response as it is after."""
    response_id = str(found.response["id"])
    if found.finished or not found.background or await store.leased(response_id):
        return found
    await asyncio.sleep(LAPSE_GRACE_S)  # (a renewal is the only news: there is no event to wait on)
    if await store.leased(response_id):
        return found
    await finish(store, found.response, len(await store.read(response_id, -1, 0)), None, REPLICA_LOST)
    return await store.load(response_id, found.owner) or found


async def follow(store: ResponseStore, response: dict[str, Any], after: int, wait_s: float) -> AsyncIterator[str]:
    """A background answer's events after ``after``: those logged, then each as it is logged, to
    the last. Each time the log is quiet (for ``wait_s``, at most :data:`QUIET_S`) the reader asks
    whether the answer is still stored: one deleted, evicted or expired ends here with a
    ``response_gone`` event, within a second of it going and without spinning on a log that is no
    longer there; one whose producer's lease stayed lapsed :data:`LAPSE_GRACE_S` is ended here
    (:data:`REPLICA_LOST`), once for every reader. A store that stays down past what ``store``
    waits (:mod:`.patient`) ends the reader with ``store_unavailable``."""
    try:
        async for event in _follow(store, response, after, wait_s):
            yield event
            after += 1
    except StoreDown as down:
        yield responses_error_event(down.status, down.message, down.code, after + 1).decode()


async def _follow(store: ResponseStore, response: dict[str, Any], after: int, wait_s: float) -> AsyncIterator[str]:
    response_id = str(response["id"])
    lapsed_at: float | None = None
    while True:
        events = await store.read(response_id, after, min(wait_s, QUIET_S))
        for number, event in events:
            yield event
            after = number
            if is_terminal(event):
                return
        if events:
            lapsed_at = None
            continue
        if not await store.exists(response_id):  # it expired, or was deleted or evicted, while read
            yield responses_error_event(410, "the response is no longer stored", "response_gone", after + 1).decode()
            return
        if await store.leased(response_id):
            lapsed_at = None
            continue
        if lapsed_at is None or time.monotonic() - lapsed_at < LAPSE_GRACE_S:
            lapsed_at = lapsed_at or time.monotonic()
            continue
        logged = await store.read(response_id, -1, 0)
        if logged and is_terminal(logged[-1][1]):
            if logged[-1][0] <= after:  # it ended at or before ``after``: nothing more comes
                return
            continue  # another reader ended it just now: read its end
        await finish(store, response, len(logged), None, REPLICA_LOST)
