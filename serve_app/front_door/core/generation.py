"""Generation: one answer of the engine, from its first item to its end, the same for every door.

:meth:`Generation.start` sends the admitted request to the model (:class:`Model`: this replica's
engine, :mod:`serve_app.front_door.core.local_engine`) and waits for the answer to begin, under the
first-token deadline and the rules of what is sent again (:func:`call_engine`). Its first item is
a :class:`~serve_app.protocol.WholeAnswer` (a whole answer, or an error found before any token) or the
first SSE chunk; :meth:`Generation.chunks` then yields the stream's chunks as they come, bytes as
the engine framed them, and ends a stream that fails after it started with one error event in the
door's form (``error_event``). The answer's :class:`~serve_app.protocol.Outcome` is read on the way
and kept in the request's record; its tokens are charged to its key as they are made (at least
every :data:`CHARGE_EVERY_S`) and settled at its end. :meth:`Generation.aclose` ends it whatever
happened: it aborts the engine's request if it still runs, settles its tokens and closes its
permit, once. Every door (HTTP, gRPC, background answers) reads its answers through this one
class; what differs is only how each writes a chunk out.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from ray.exceptions import TaskCancelledError

from serve_app.errors import UNAVAILABLE, APIError, overloaded, sse_error_event
from serve_app.front_door.admission.deadlines import Deadline, DeadlineExceeded, ItemsBefore, next_before
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.core.stream_watch import StallWatch, StreamStalled, stalled_error
from serve_app.front_door.telemetry.record import Phase, RequestRecord
from serve_app.observability.tracing import trace_context
from serve_app.protocol import AnswerItem, GenerationRequest, Outcome, WholeAnswer, trailing_error

logger = logging.getLogger("ray.serve")

RETRY_INTERVAL_S = 0.5  # between attempts on an unavailable replica: long enough for a dead one to leave routing
CHARGE_EVERY_S = 5.0  # a long answer's tokens are charged to its key at least this often


class ErrorEvent(Protocol):
    """A stream's last event when it fails after it started, in its door's form: status, message,
    code, and how many events the stream sent before it (a Responses stream's sequence number)."""

    def __call__(self, status: int, message: str, code: str | None, sent: int) -> bytes: ...


def chat_error_event(status: int, message: str, code: str | None, sent: int) -> bytes:
    """Chat's and completions' error event (OpenAI's ``data: {"error": ...}``)."""
    return sse_error_event(status, message, code)


class AnswerStream(Protocol):
    """One generation's answer as it comes: iterate it; cancel it to stop the generation."""

    def __aiter__(self) -> AnswerStream: ...

    async def __anext__(self) -> AnswerItem: ...

    def cancel(self) -> None: ...


class Model(Protocol):
    """What answers the front door's generation requests (in production, this replica's engine:
    :class:`~serve_app.front_door.core.local_engine.LocalModel`)."""

    def generate(
        self, method: str, payload: GenerationRequest, trace_context: dict[str, str] | None
    ) -> AnswerStream: ...


class Generation:
    """One answer (see the module's docstring): :meth:`start`, then :meth:`chunks` of a stream;
    :meth:`aclose` in every case. ``error``: what ended it in failure, once it did."""

    def __init__(
        self,
        model: Model,
        method: str,
        payload: GenerationRequest,
        deadline: Deadline,
        record: RequestRecord,
        permit: Permit,
        retry_s: float = 0.0,
        error_event: ErrorEvent = chat_error_event,
        watch: StallWatch | None = None,
    ) -> None:
        self.model, self.method, self.payload = model, method, payload
        self.deadline, self.record, self.permit = deadline, record, permit
        self.retry_s = retry_s
        self.error_event = error_event
        self.watch = watch or StallWatch(None)
        self.error: APIError | None = None
        self._first: WholeAnswer | str | None = None
        self._rest: AnswerStream | None = None
        self._events = 0  # events sent (each "data: " line)
        self._ended = False
        permit.answer_end = self._end

    async def start(self) -> WholeAnswer | str:
        """The answer's first item: a whole :class:`WholeAnswer` (the answer has ended: its tokens are
        settled, its permit closed) or the first chunk of a stream. Raises the :class:`APIError` a
        client gets when no answer began."""
        try:
            self._first, self._rest = await call_engine(
                self.model, self.method, self.payload, self.deadline, self.record, self.retry_s
            )
        except BaseException:
            self._end()
            raise
        if isinstance(self._first, WholeAnswer):
            self.record.outcome = self._first.outcome
            self.record.error_code = self._first.code
            self._end()
        return self._first

    async def chunks(self) -> AsyncGenerator[str | bytes, None]:
        """The stream's chunks from its first; a failure after the start becomes a final error event
        (nothing follows it). Ends the generation when it ends, however it ends."""
        first, rest = self._first, self._rest
        assert isinstance(first, str) and rest is not None, "chunks() reads a stream that started"
        record, watch = self.record, self.watch
        charge_at = asyncio.get_running_loop().time() + CHARGE_EVERY_S
        failed = False  # an error event was written: nothing follows it, only the Outcome is still read
        items = ItemsBefore(rest, self.deadline.end_at)
        watched = watch.watch(lambda: items.interrupt(StreamStalled))
        try:
            failed = self._ends_in_error(first)
            yield first
            self._events += first.count("data: ")
            while True:
                watch.waits(watched)
                try:
                    chunk = await items.next()
                except StopAsyncIteration:
                    break
                watch.got(watched)
                if isinstance(chunk, Outcome):
                    record.outcome = chunk
                    continue
                if failed or not isinstance(chunk, str):
                    continue
                failed = self._ends_in_error(chunk)
                yield chunk
                self._events += chunk.count("data: ")
                if self.permit.counts_tokens and (now := asyncio.get_running_loop().time()) >= charge_at:
                    self.permit.charge(self._events - self.permit.charged)  # (tokens made so far, at least)
                    charge_at = now + CHARGE_EVERY_S
        except DeadlineExceeded:
            if not failed:
                yield self.fail(self.deadline.expired())
        except StreamStalled:
            if not failed:
                assert watch.timeout_s is not None
                yield self.fail(stalled_error(watch.timeout_s))
        except TaskCancelledError:  # the client left; nobody reads an error event
            pass
        except Exception as exc:
            # After the engine's own error event (its engine died, and the replica is leaving), the
            # call's failure is the same event's consequence: one error per stream.
            if not failed:
                yield self.fail(call_failure(exc))
        finally:
            watch.forget(watched)
            items.close()
            self._end()

    async def aclose(self) -> None:
        """End the answer: abort the engine's request if it still runs, settle its tokens, close its permit."""
        self._end()

    def _ends_in_error(self, chunk: str) -> bool:
        error = trailing_error(chunk)
        if error is None:
            return False
        self.record.failed(error.status, error.code)
        self.error = error
        return True

    def fail(self, error: APIError) -> bytes:
        """The answer failed with ``error`` after its response began: its error event, recorded."""
        self.record.failed(error.status, error.code)
        self.error = error
        return self.error_event(error.status, error.message, error.code, self._events)

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._rest is not None:
            self._rest.cancel()  # no-op when finished; aborts generation on timeout or when the client left
        outcome = self.record.outcome
        self.permit.settle(outcome.total_tokens if outcome is not None else self._events)
        self.permit.close()


def call_failure(exc: BaseException) -> APIError:
    """Map a failure to reach or hear from a model replica (another one's, through Serve's handle)
    to the status a client should see."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )

    if isinstance(exc, BackPressureError):
        return overloaded()
    if isinstance(
        exc,
        (DeploymentUnavailableError, ReplicaUnavailableError, ActorDiedError, ActorUnavailableError, RayActorError),
    ):
        return APIError(
            503, "the model replica is unavailable; retry shortly", code=UNAVAILABLE, headers={"Retry-After": "1"}
        )
    logger.exception("request failed in a model replica", exc_info=exc)
    return APIError(500, "internal error while generating the answer", code="internal_error")


def may_have_reached_an_engine(exc: BaseException) -> bool:
    """Whether a failed call to a replica may have been running in its engine.

    A replica process that died (or went unreachable) during the call may have
    been running it; the request may even be what killed it. A deployment with no
    replica to take the call never started it. (An engine that dies under a live
    replica is answered by the replica itself, ``engine_failed``.)
    """
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(exc, RayActorError | ReplicaUnavailableError)


async def call_engine(
    model: Model,
    method: str,
    payload: GenerationRequest,
    deadline: Deadline,
    record: RequestRecord,
    retry_s: float = 0.0,
) -> tuple[WholeAnswer | str, AnswerStream]:
    """Send ``payload`` to the model's ``method``; its first item and the rest of its answer.

    A stream's first chunk must come before the first-token deadline; a unary
    answer, which is its whole first item, before the end deadline.

    Only what never reached an engine is sent again: a replica's refusal before
    admission (503 ``unavailable``: its engine was already dead) or a deployment
    with no replica, to whichever replica Serve picks, for up to ``retry_s``
    seconds from the first refusal (a replica whose engine died exits within
    seconds, and each router drops it on its first failed call). A request whose
    engine died under it is answered once (``engine_failed``), since it may be
    what killed the engine; a replica process that died during the call is tried
    on one more replica at most, so no request can take down replica after replica.
    """
    streaming = bool(payload.stream)
    first_by = deadline.first_token_at if streaming else deadline.end_at
    retry_until: float | None = None  # set at the first refusal
    replica_deaths = 0  # calls that failed because their replica process died

    def give_up_at() -> float:
        nonlocal retry_until
        if retry_until is None:
            retry_until = min(asyncio.get_running_loop().time() + retry_s, first_by)
        return retry_until

    record.enter(Phase.QUEUED)
    while True:
        record.attempts += 1
        responses = model.generate(method, payload, trace_context(record.span))
        try:
            first = await next_before(responses, first_by)
        except StopAsyncIteration:
            raise APIError(500, "the model replica returned no answer", code="internal_error") from None
        except DeadlineExceeded:
            responses.cancel()
            raise (deadline.first_token_expired() if streaming else deadline.expired()) from None
        except asyncio.CancelledError:  # the client left before the answer began
            responses.cancel()
            raise
        except TaskCancelledError:  # Serve cancelled it because the client left
            raise
        except Exception as exc:
            error = call_failure(exc)
            replica_deaths += may_have_reached_an_engine(exc)
            if error.status == 503 and replica_deaths <= 1 and await _before_retry(give_up_at()):
                continue
            raise error from None
        if isinstance(first, Outcome):  # an answer begins with a whole answer or a chunk, never its outcome
            responses.cancel()
            raise APIError(500, "the model replica returned no answer", code="internal_error")
        if isinstance(first, WholeAnswer) and first.code == UNAVAILABLE and await _before_retry(give_up_at()):
            continue
        break
    record.enter(Phase.RUNNING)
    return first, responses


async def _before_retry(until: float, interval_s: float = RETRY_INTERVAL_S) -> bool:
    """Wait one retry interval if another attempt still fits before ``until``; say whether it does."""
    if asyncio.get_running_loop().time() + interval_s >= until:
        return False
    await asyncio.sleep(interval_s)
    return True
