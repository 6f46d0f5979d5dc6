"""Background answers: generated detached from the connection that asked, logged event by event
where any replica's reader follows them (:func:`follow`), stopped by a cancel from any replica.

:class:`BackgroundAnswers` is the replica's set of the answers it generates: each runs as a task
(:func:`produce`), their leases renewed together while the replica lives, and the replica
listens for cancels (the store's :meth:`~.store.ResponseStore.cancel_requests`). A reader that
finds an answer's log quiet and its lease lapsed (its replica died) ends it: a ``failed``
response and an ``error`` event, written once whoever writes it first (a sequence number is
taken once).

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from serve_app.errors import APIError, responses_error_event
from serve_app.front_door.admission.deadlines import Deadline, DeadlineExceeded, next_before
from serve_app.front_door.answer_log.store import (
    ResponseStore,
    StoredResponse,
    event_response,
    event_type,
    is_terminal,
    split_events,
)
from serve_app.front_door.core.generation import Model, TokenCounter, call_replica, replica_failure, settle_reply
from serve_app.front_door.telemetry.record import RequestRecord
from serve_app.protocol import GenerationRequest, Outcome, Reply

logger = logging.getLogger("ray.serve")

CANCELLED = (499, "the response was cancelled", "response_cancelled")
REPLICA_LOST = (
    503,
    "the replica generating this response stopped before it ended; send the request again",
    "replica_lost",
)
LISTEN_RETRY_S = 1.0  # after the cancel listener lost its store


class BackgroundAnswers:
    """The background answers this replica generates: at most ``limit`` at once (429 past it)."""

    def __init__(self, store: ResponseStore, limit: int, lease_s: float) -> None:
        self.store = store
        self.limit = limit
        self.lease_s = lease_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._helpers: list[asyncio.Task[None]] = []

    async def run(self, response_id: str, answer: Coroutine[Any, Any, None], keep: Coroutine[Any, Any, None]) -> None:
        """Start generating ``answer`` (:func:`produce`) once ``keep`` kept its response, leased
        from before it is kept (a reader never finds it kept and unleased while it starts)."""
        if len(self._tasks) >= self.limit:
            answer.close()
            keep.close()
            raise APIError(
                429,
                f"this replica generates {self.limit} background responses already; retry shortly",
                code="background_limit",
                headers={"Retry-After": "1"},
            )
        if not self._helpers:
            self._helpers = [asyncio.create_task(self._renew()), asyncio.create_task(self._listen())]
        await self.store.renew_lease([response_id], self.lease_s)
        try:
            await keep
        except BaseException:
            answer.close()
            raise
        task = asyncio.create_task(answer, name=f"background {response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    async def cancel(self, response_id: str) -> None:
        """Stop the answer here if this replica generates it, else ask the one that does."""
        if (task := self._tasks.get(response_id)) is not None:
            task.cancel()
        else:
            await self.store.request_cancel(response_id)

    async def _renew(self) -> None:
        while True:
            if self._tasks:
                with contextlib.suppress(Exception):  # a store that does not answer: the leases lapse
                    await self.store.renew_lease(list(self._tasks), self.lease_s)
            await asyncio.sleep(self.lease_s / 3)  # the renewal period, a third of the lease

    async def _listen(self) -> None:
        while True:
            try:
                async for response_id in self.store.cancel_requests():
                    if (task := self._tasks.get(response_id)) is not None:
                        task.cancel()
            except Exception:
                logger.warning("the cancel listener lost the response store; listening again", exc_info=True)
            await asyncio.sleep(LISTEN_RETRY_S)

    async def drain(self) -> None:
        """Wait for every answer under way here to end (the replica is stopping: Serve drained its
        requests, and a background answer is none of them), leases renewed meanwhile."""
        if self._tasks:
            logger.info("waiting for %d background responses to end before the replica stops", len(self._tasks))
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def close(self) -> None:
        for task in [*self._helpers, *self._tasks.values()]:
            task.cancel()


async def produce(
    store: ResponseStore,
    response: dict[str, Any],
    model: Model,
    payload: GenerationRequest,
    deadline: Deadline,
    on_tokens: TokenCounter | None,
    retry_s: float = 0.0,
) -> None:
    """Generate a background answer, appending each event to its log, and keep its final object
    (``retry_s``: as long as a request no replica started is sent again, as for any request)."""
    response_id = str(response["id"])
    record = RequestRecord("responses", request_id=response_id, stream=True)
    written = 0
    final: dict[str, Any] | None = None
    failure: tuple[int, str, str | None] | None = None

    async def log(event: str) -> None:
        nonlocal written, final
        await store.append(response_id, written, event)
        if written == 0:
            await store.update(response_id, response | {"status": "in_progress"})
        written += 1
        if is_terminal(event) and event_type(event) != "error":
            final = event_response(event)

    rest = None
    try:
        first, rest = await call_replica(model, "responses", payload, deadline, record, retry_s)
        if isinstance(first, Reply):  # refused before it began
            settle_reply(first, record, on_tokens)
            error = json.loads(first.body).get("error") or {}
            failure = (first.status, str(error.get("message", "")), error.get("code"))
        else:
            assert isinstance(first, str)
            for event in split_events(first):
                await log(event)
            while True:
                try:
                    chunk = await next_before(rest, deadline.end_at)
                except StopAsyncIteration:
                    break
                if isinstance(chunk, Outcome):
                    record.outcome = chunk
                elif isinstance(chunk, str):
                    for event in split_events(chunk):
                        await log(event)
    except asyncio.CancelledError:
        failure = CANCELLED
    except DeadlineExceeded:
        expired = deadline.expired()
        failure = (expired.status, expired.message, expired.code)
    except APIError as error:
        failure = (error.status, error.message, error.code)
    except Exception as exc:
        lost = replica_failure(exc)
        failure = (lost.status, lost.message, lost.code)
    finally:
        if rest is not None:
            rest.cancel()
    if on_tokens is not None and record.outcome is not None:
        on_tokens(record.outcome.total_tokens)
    await finish(store, response, written, final, failure)
    logger.info("background response %s ended %s", response_id, (final or {}).get("status") or failure)


async def finish(
    store: ResponseStore,
    response: dict[str, Any],
    written: int,
    final: dict[str, Any] | None,
    failure: tuple[int, str, str | None] | None,
) -> bool:
    """End an answer's log and keep its last object: ``final`` (the answer's own end) or, on a
    ``failure``, an error event and a ``failed`` (``cancelled``) object. False when another
    writer ended it first."""
    if final is not None and failure is None:
        await store.update(str(response["id"]), final)
        return True
    status, message, code = failure or (500, "the answer ended without its final event", "internal_error")
    event = responses_error_event(status, message, code, written).decode()
    if not await store.append(str(response["id"]), written, event):
        return False
    ended = "cancelled" if (status, message, code) == CANCELLED else "failed"
    await store.update(str(response["id"]), response | {"status": ended, "error": {"code": code, "message": message}})
    return True


async def end_if_orphaned(store: ResponseStore, found: StoredResponse) -> StoredResponse:
    """A background answer whose producer's lease lapsed (its replica died) ended here, ``failed``
    with :data:`REPLICA_LOST`, as a reader would end it; the response as it is after."""
    response_id = str(found.response["id"])
    if found.finished or not found.background or await store.leased(response_id):
        return found
    await finish(store, found.response, len(await store.read(response_id, -1, 0)), None, REPLICA_LOST)
    return await store.load(response_id, found.owner) or found


async def follow(store: ResponseStore, response: dict[str, Any], after: int, wait_s: float) -> AsyncIterator[str]:
    """A background answer's events after ``after``: those logged, then each as it is logged, to
    the last. If the log is quiet for ``wait_s`` and its producer's lease has lapsed, the answer
    is ended here (:data:`REPLICA_LOST`), once for every reader."""
    response_id = str(response["id"])
    while True:
        events = await store.read(response_id, after, wait_s)
        for number, event in events:
            yield event
            after = number
            if is_terminal(event):
                return
        if events or await store.leased(response_id):
            continue
        if not await store.exists(response_id):  # it expired, or was deleted, while read
            yield responses_error_event(410, "the response is no longer stored", "response_gone", after + 1).decode()
            return
        logged = await store.read(response_id, -1, 0)
        if logged and is_terminal(logged[-1][1]):
            if logged[-1][0] <= after:  # it ended at or before ``after``: nothing more comes
                return
            continue  # another reader ended it just now: read its end
        await finish(store, response, len(logged), None, REPLICA_LOST)
