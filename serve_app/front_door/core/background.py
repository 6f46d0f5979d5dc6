"""Background answers: generated detached from the request that asked, logged event by event where
any replica's reader follows them (:mod:`serve_app.front_door.answer_log.follow`), stopped by a
cancel from any replica, and held to the same places as any request for their whole life.

:class:`BackgroundAnswers` is the replica's set of the answers it generates or queues (Responses
API ``background``, gRPC ``store``): each runs as a task, their leases in the answer log renewed
together while the replica lives, and the replica listens for cancels. An answer whose request
was admitted with its key's place takes the request's permit over (its replica places, its key's
lease, its tokens charged as they are made) and gives it back when it ends. Past its key's
``max_concurrent_requests`` it is kept ``queued`` and waits, in the order it came, until a place
of its key and of the replica are free (:meth:`BackgroundAnswers.places_freed` on every place
given back here; every second for places freed elsewhere); then it takes them and its fair-share
rank. At most ``max_waiting_per_key`` of one key wait per replica (429 ``background_queue_full``
past it), and at most ``limit`` answers run or wait (429 ``background_limit``); both counts are
taken before anything is awaited, so a burst cannot pass them.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import aclosing
from typing import Any

from serve_app.errors import APIError
from serve_app.front_door.admission.deadlines import Deadline, TimeLimits
from serve_app.front_door.answer_log.follow import CANCELLED, REPLICA_STOPPED, Failure, finish
from serve_app.front_door.answer_log.store import (
    ResponseStore,
    StoreDown,
    event_response,
    event_type,
    is_terminal,
    split_events,
)
from serve_app.front_door.core.generation import Generation
from serve_app.front_door.core.permit import Permit

logger = logging.getLogger("ray.serve")

LISTEN_RETRY_S = 1.0  # after the cancel listener lost its store
RENEW_RETRY_S = 0.5  # after a renewal the store did not take (within follow.LAPSE_GRACE_S, twice)
WAIT_RETRY_S = 1.0  # a waiting answer asks again this often (a place freed on another replica tells nobody here)

PermitSource = Callable[[str | None, int], Awaitable[Permit]]  # a key's places now, or the 429 of the one not free
GetPermit = Callable[[], Awaitable[Permit]]  # an answer's permit: at once, or once it waited for one
Produce = Callable[[GetPermit], Coroutine[Any, Any, None]]  # an answer's generation, given how to get its permit


class BackgroundAnswers:
    """The background answers this replica generates or queues (see the module's docstring)."""

    def __init__(self, store: ResponseStore, limit: int, lease_s: float, max_waiting_per_key: int = 0) -> None:
        self.store = store
        self.limit = limit
        self.lease_s = lease_s
        self.max_waiting_per_key = max_waiting_per_key
        self.permits: PermitSource | None = None  # the core's (FrontDoor.permit_now)
        self._tasks: dict[str, asyncio.Task[None] | None] = {}  # (None: taken, being kept)
        self._waiting: Counter[str] = Counter()  # answers waiting for places, by key
        self._turns: dict[str, asyncio.Lock] = {}  # each key's waiting answers, served in the order they came
        self._freed = asyncio.Event()
        self._helpers: list[asyncio.Task[None]] = []
        self._stopping = False

    @property
    def waiting(self) -> int:
        return sum(self._waiting.values())

    async def start(
        self,
        answer_id: str,
        key_id: str | None,
        permit: Permit | None,
        sequences: int,
        save: Coroutine[Any, Any, None],
        produce: Produce,
    ) -> None:
        """Keep the answer (``save``: its object, ``queued``) and start generating it (``produce``)
        under ``permit`` (taken over), or with none (its key was at its cap), once it has waited for
        one. Leased before it is kept: a reader never finds it kept and unleased while it starts."""
        key = key_id or ""
        try:
            if self._stopping:
                raise replica_stopped()
            if len(self._tasks) >= self.limit:
                raise APIError(
                    429,
                    f"this replica holds {self.limit} background responses already; retry shortly",
                    code="background_limit",
                    headers={"Retry-After": "1"},
                )
            if permit is None and self._waiting[key] >= self.max_waiting_per_key:
                raise APIError(
                    429,
                    f"this API key has {self._waiting[key]} background responses waiting for its place on this "
                    "replica already (rate_limits.max_concurrent_requests runs at once); retry later",
                    code="background_queue_full",
                    headers={"Retry-After": "1"},
                )
        except APIError:
            save.close()
            raise
        held = permit.hand_over() if permit is not None else None
        self._tasks[answer_id] = None  # (taken now: the bounds above hold however many come at once)
        if held is None:
            self._waiting[key] += 1
        if not self._helpers:
            self._helpers = [asyncio.create_task(self._renew()), asyncio.create_task(self._listen())]
        try:
            await self.store.renew_lease([answer_id], self.lease_s)
            await save
        except BaseException:
            self._forget(answer_id, key, waiting=held is None)
            if held is not None:
                held.close()
            raise
        task = asyncio.create_task(self._run(key, held, sequences, produce), name=f"background {answer_id}")
        self._tasks[answer_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(answer_id, None))

    async def _run(self, key: str, permit: Permit | None, sequences: int, produce: Produce) -> None:
        taken: list[Permit] = [permit] if permit is not None else []

        async def get_permit() -> Permit:
            if not taken:
                try:
                    taken.append(await self._wait_for_places(key, sequences))
                finally:
                    self._forget_waiting(key)
            return taken[0]

        try:
            await produce(get_permit)
        finally:
            for held in taken:
                held.close()

    async def _wait_for_places(self, key: str, sequences: int) -> Permit:
        assert self.permits is not None, "the core gives its permits"
        turn = self._turns.setdefault(key, asyncio.Lock())
        async with turn:  # (asyncio's lock wakes its waiters in the order they came)
            while True:
                if self._stopping:
                    raise replica_stopped()
                freed = self._freed
                try:
                    return await self.permits(key or None, sequences)
                except APIError as refused:
                    if refused.status != 429:
                        raise
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WAIT_RETRY_S):  # (not wait_for: it can swallow a cancel in 3.11)
                        await freed.wait()

    def places_freed(self) -> None:
        """A place was given back here: the waiting answers ask again."""
        if self.waiting:
            self._freed.set()
            self._freed = asyncio.Event()

    def _forget_waiting(self, key: str) -> None:
        self._waiting[key] -= 1
        if not self._waiting[key]:
            del self._waiting[key]
            turn = self._turns.get(key)
            if turn is not None and not turn.locked():
                del self._turns[key]

    def _forget(self, answer_id: str, key: str, waiting: bool) -> None:
        self._tasks.pop(answer_id, None)
        if waiting:
            self._forget_waiting(key)

    async def cancel(self, answer_id: str) -> None:
        """Stop the answer here if this replica generates it, else ask the one that does."""
        if (task := self._tasks.get(answer_id)) is not None:
            task.cancel()
        else:
            await self.store.request_cancel(answer_id)

    async def _renew(self) -> None:
        while True:
            period = self.lease_s / 3  # the renewal period, a third of the lease
            if self._tasks:
                try:
                    await self.store.renew_lease(list(self._tasks), self.lease_s)
                except Exception:  # a store that does not answer: renewed again soon, as it comes back
                    period = min(period, RENEW_RETRY_S)
            await asyncio.sleep(period)

    async def _listen(self) -> None:
        while True:
            try:
                async for answer_id in self.store.cancel_requests():
                    if (task := self._tasks.get(answer_id)) is not None:
                        task.cancel()
            except Exception:
                logger.warning("the cancel listener lost the response store; listening again", exc_info=True)
            await asyncio.sleep(LISTEN_RETRY_S)

    async def drain(self) -> None:
        """The replica is stopping (Serve drained its requests, and a background answer is none of
        them): answers still waiting for their places end ``replica_stopped`` (503, sent again they run
        elsewhere); those under way run to their end, their leases renewed meanwhile."""
        self._stopping = True
        self._freed.set()  # (the waiting answers look again, and end)
        tasks = [task for task in self._tasks.values() if task is not None]
        if tasks:
            logger.info("waiting for %d background responses to end before the replica stops", len(tasks))
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in [*self._helpers, *self._tasks.values()]:
            if task is not None:
                task.cancel()


class LogRefused(Exception):
    """An answer's log refused its producer's next event: another writer ended it, or it is gone."""


def replica_stopped() -> APIError:
    """The end of an answer still waiting for its places when its replica stops (or taken by one stopping)."""
    status, message, code = REPLICA_STOPPED
    return APIError(status, message, code=code, headers={"Retry-After": "1"})


async def produce_response(
    store: ResponseStore,
    response: dict[str, Any],
    get_permit: GetPermit,
    generation_for: Callable[[Permit, Deadline], Generation],
    time_limits: TimeLimits,
) -> None:
    """Generate a Responses API background answer once it has its permit, appending each event to its
    log under its sequence number, and save its final object (``failed`` with the error that ended it).

    The answer has one writer: once its log refuses an event (a reader ended it, its lease having
    lapsed; or it was deleted or expired), the producer stops at once, aborting its engine request,
    and writes nothing more, so an answer never has two ends. ``store`` waits out an outage
    (:mod:`serve_app.front_door.answer_log.patient`); one longer stops the answer too, unended
    (its lease lapses, and its first reader after the store is back ends it)."""
    response_id = str(response["id"])
    written = 0
    final: dict[str, Any] | None = None
    failure: Failure | None = None
    error_logged = False

    async def log(event: str) -> None:
        nonlocal written, final
        if not await store.append(response_id, written, event):
            raise LogRefused(response_id)
        if written == 0:
            await store.update(response_id, response | {"status": "in_progress"})
        written += 1
        if is_terminal(event) and event_type(event) != "error":
            final = event_response(event)

    generation: Generation | None = None
    try:
        permit = await get_permit()
        generation = generation_for(permit, Deadline.start(time_limits))  # (its time runs from here)
        first = await generation.start()
        if not isinstance(first, str):  # refused before it began
            error = json.loads(first.body).get("error") or {}
            failure = (first.status, str(error.get("message", "")), error.get("code"))
        else:
            async with aclosing(generation.chunks()) as chunks:
                async for chunk in chunks:
                    for event in split_events(chunk if isinstance(chunk, str) else chunk.decode()):
                        await log(event)
            if generation.error is not None:
                failure, error_logged = (generation.error.status, generation.error.message, generation.error.code), True
    except LogRefused:
        logger.info("background response %s stopped: its log was ended or removed by another", response_id)
        return  # (after the generation's aclose below)
    except StoreDown as down:
        logger.warning("background response %s stopped: %s", response_id, down.message)
        return
    except asyncio.CancelledError:
        failure = CANCELLED
    except APIError as error:
        failure = (error.status, error.message, error.code)
    finally:
        if generation is not None:
            await generation.aclose()
    try:
        await finish(store, response, written, final, failure, error_logged)
    except StoreDown as down:
        logger.warning("background response %s could not be ended: %s", response_id, down.message)
        return
    logger.info("background response %s ended %s", response_id, (final or {}).get("status") or failure)
