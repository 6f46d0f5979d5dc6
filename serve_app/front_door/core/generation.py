"""Calling the engine from the front door: one request, its retries, its deadlines, its stream.

:func:`call_replica` sends a validated request to the model (:class:`Model`: this replica's
engine, :mod:`serve_app.front_door.core.local_engine`) and waits for the answer to begin; :func:`relay` turns it
into an HTTP response: a :class:`Reply` becomes a JSON response, a stream is
written through as SSE (:func:`stream_sse`), bytes as they are, with a final
error event if it fails after it started. (The gRPC service reads the same
stream through :func:`stream_sse` too.) What is
sent again, and what is never (:func:`may_have_reached_an_engine`), is decided
here; what a failure looks like to a client is :func:`replica_failure`.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from ray.exceptions import TaskCancelledError
from starlette.responses import Response, StreamingResponse

from serve_app.errors import UNAVAILABLE, APIError, overloaded, responses_error_event, sse_error_event
from serve_app.front_door.admission.deadlines import Deadline, DeadlineExceeded, next_before
from serve_app.front_door.telemetry.record import Phase, RequestRecord
from serve_app.observability.tracing import trace_context
from serve_app.protocol import Answer, GenerationRequest, Outcome, Reply, trailing_error

logger = logging.getLogger("ray.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


TokenCounter = Callable[[int], None]  # told the tokens an answer used, once it ends
ErrorEvent = Callable[[int, str, str | None], bytes]  # a stream's final error event: status, message, code


class AnswerStream(Protocol):
    """One generation's answer as it comes: iterate it; cancel it to stop the generation."""

    def __aiter__(self) -> AnswerStream: ...

    async def __anext__(self) -> Answer: ...

    def cancel(self) -> None: ...


class Model(Protocol):
    """What answers the front door's generation requests (in production, this replica's engine:
    :class:`~serve_app.front_door.core.local_engine.LocalModel`)."""

    def generate(
        self, method: str, payload: GenerationRequest, trace_context: dict[str, str] | None
    ) -> AnswerStream: ...


RETRY_INTERVAL_S = 0.5  # between attempts on an unavailable replica: long enough for a dead one to leave routing


def replica_failure(exc: BaseException) -> APIError:
    """Map a failure to reach or hear from a replica to the status a client should see."""
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


async def stream_sse(
    first: str,
    rest: Any,
    deadline: Deadline,
    record: RequestRecord,
    on_tokens: TokenCounter | None = None,
    error_event: ErrorEvent = sse_error_event,
) -> AsyncGenerator[str | bytes, None]:
    """Write a replica's SSE stream through; a failure after the start becomes a final error event
    (``error_event``'s: a Responses API stream's has its own form).

    The replica ends the stream with an :class:`Outcome` (not written out), kept in
    ``record``. With ``on_tokens``, it is told the answer's total tokens; a stream
    cut short (the client left) is counted as one token per event it was sent.
    """
    events = 0
    ended = False  # an error event was written: nothing follows it, only the Outcome is still read
    try:
        if (ending := trailing_error(first)) is not None:
            record.failed(*ending)
            ended = True
        yield first
        events += first.count("data: ") if on_tokens else 0
        while True:
            try:
                chunk = await next_before(rest, deadline.end_at)
            except StopAsyncIteration:
                break
            if isinstance(chunk, Outcome):
                record.outcome = chunk
                continue
            if ended:
                continue
            events += chunk.count("data: ") if on_tokens else 0
            if (ending := trailing_error(chunk)) is not None:  # the replica ended the stream with an error
                record.failed(*ending)
                ended = True
            yield chunk
    except DeadlineExceeded:
        if not ended:
            error = deadline.expired()
            record.failed(error.status, error.code)
            yield error_event(error.status, error.message, error.code)
    except TaskCancelledError:  # the client left; nobody reads an error event
        pass
    except Exception as exc:
        # After the replica's own error event (its engine died, and the replica is
        # leaving), the call's failure is the same event's consequence: one error per stream.
        if not ended:
            error = replica_failure(exc)
            record.failed(error.status, error.code)
            yield error_event(error.status, error.message, error.code)
    finally:
        rest.cancel()  # no-op when finished; aborts generation on timeout or when the client left
        if on_tokens is not None:
            on_tokens(record.outcome.total_tokens if record.outcome is not None else events)


async def relay(
    model: Model,
    method: str,
    payload: GenerationRequest,
    deadline: Deadline,
    record: RequestRecord,
    retry_s: float = 0.0,
    on_tokens: TokenCounter | None = None,
) -> Response:
    """Send ``payload`` to the model (:func:`call_replica`) and answer over HTTP with its reply or stream."""
    first, responses = await call_replica(model, method, payload, deadline, record, retry_s)
    if isinstance(first, Reply):
        settle_reply(first, record, on_tokens)
        # A replica that cannot serve right now (its engine died) says so with 503: retry.
        headers = {"Retry-After": "1"} if first.status == 503 else None
        return Response(first.body, status_code=first.status, headers=headers, media_type="application/json")
    error_event = responses_error_event if method == "responses" else sse_error_event
    return StreamingResponse(
        stream_sse(first, responses, deadline, record, on_tokens, error_event),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def settle_reply(reply: Reply, record: RequestRecord, on_tokens: TokenCounter | None) -> None:
    """Record a whole reply's outcome and charge its tokens."""
    record.outcome = reply.outcome
    record.error_code = reply.code
    if on_tokens is not None and reply.outcome is not None:
        on_tokens(reply.outcome.total_tokens)


async def call_replica(
    model: Model,
    method: str,
    payload: GenerationRequest,
    deadline: Deadline,
    record: RequestRecord,
    retry_s: float = 0.0,
) -> tuple[Reply | str, AnswerStream]:
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
            error = replica_failure(exc)
            replica_deaths += may_have_reached_an_engine(exc)
            if error.status == 503 and replica_deaths <= 1 and await _before_retry(give_up_at()):
                continue
            raise error from None
        if isinstance(first, Outcome):  # an answer begins with a reply or a chunk, never its outcome
            responses.cancel()
            raise APIError(500, "the model replica returned no answer", code="internal_error")
        if isinstance(first, Reply) and first.code == UNAVAILABLE and await _before_retry(give_up_at()):
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
