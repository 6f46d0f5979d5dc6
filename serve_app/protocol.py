"""What passes between the front door and the engine of a model replica.

The front door calls the engine's ``chat`` or ``completion`` with a validated vLLM
request (or, for a large body, a :class:`PickledRequest`) and the trace
context. The replica answers every call with an async generator of
:data:`AnswerItem`s. Its first item decides the HTTP answer: a :class:`WholeAnswer`
(a complete JSON body with its status: a unary response or an error found before
any token) or the first piece of an SSE stream, already framed as
``data: ...\\n\\n`` by vLLM's serving code. The front door writes those bytes to the
socket as they are: nothing is re-encoded per token. A stream's last item is its
:class:`Outcome`, never written to the client; a stream that fails after it
started ends with an error event (:func:`trailing_error` reads it).

Runs in each model replica: both halves of the replica import it.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Protocol, cast

from pydantic import BaseModel

from serve_app.errors import APIError, error_body, status_of

DONE_EVENT = "data: [DONE]\n\n"
ERROR_EVENT_PREFIX = 'data: {"error"'
ERROR_EVENT_LINE = "event: error\n"  # before a Responses API stream's error event (serve_app.errors)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an answer ended: its tokens and finish reasons, for token limits, metrics and logs.

    Every stream's last generator item, never written to the client; a unary
    :class:`WholeAnswer` carries it. ``finish_reasons`` has one entry per choice that
    finished (``stop``, ``length``, ``tool_calls``, ...).
    """

    prompt_tokens: int
    completion_tokens: int
    finish_reasons: tuple[str, ...] = ()
    empty: str | None = None  # what :func:`empty_kind` found: an answer that ended with nothing in it

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


EMPTY_CONTENT, EMPTY_TOOL_ARGUMENTS = "content", "tool_arguments"  # the kinds of empty answer


def empty_kind(
    finish_reasons: tuple[str, ...], wrote_text: bool, called_tool: bool, wrote_arguments: bool
) -> str | None:
    """Whether an answer that ended is empty, and how: it stopped (``stop``) with no text and no
    tool call (:data:`EMPTY_CONTENT`), or it called tools and wrote no arguments for any
    (:data:`EMPTY_TOOL_ARGUMENTS`; ``{}`` is arguments). The failure users of GLM-4 servers report ("the
    first request is fine, the rest come back empty") looks like the first. An answer cut by its
    length, an error or its client is unfinished, not empty. (Per answer, not per choice.)"""
    if called_tool:
        return None if wrote_arguments else EMPTY_TOOL_ARGUMENTS
    if "stop" in finish_reasons and not wrote_text:
        return EMPTY_CONTENT
    return None


@dataclasses.dataclass(frozen=True)
class WholeAnswer:
    """A complete (non-streamed) answer: HTTP status and JSON body."""

    status: int
    body: bytes
    outcome: Outcome | None = None
    code: str | None = None  # an error's OpenAI ``code``, for the front door's record (retry, metrics)

    @classmethod
    def error(cls, status: int, message: str, param: str | None = None, code: str | None = None) -> WholeAnswer:
        return cls(status, json.dumps(error_body(status, message, param, code)).encode(), code=code)


AnswerItem = WholeAnswer | str | Outcome  # what a replica's generator yields


class GenerationRequest(Protocol):
    """What the front door reads of a validated request, in either form it crosses in: vLLM's
    ``ChatCompletionRequest`` or ``CompletionRequest``, or a :class:`PickledRequest`."""

    @property
    def request_id(self) -> str: ...

    @property
    def stream(self) -> bool | None: ...


def as_generation_request(request: BaseModel) -> GenerationRequest:
    """A vLLM request model seen as a :class:`GenerationRequest` (every one has both fields)."""
    return cast(GenerationRequest, request)


@dataclasses.dataclass(frozen=True)
class PickledRequest:
    """A validated vLLM request, pickled by the checker process, unpickled by the model replica.

    The bytes come from this server's own checker, never from a client.
    """

    data: bytes
    request_id: str
    stream: bool
    priority: int = 0  # set after pickling (see with_priority)
    cache_salt: str | None = None  # set after pickling (see with_cache_salt); None: as pickled

    def load(self) -> BaseModel:
        request = pickle.loads(self.data)
        request.priority = self.priority
        request.stream = self.stream  # (a background answer's is streamed, whatever its client asked)
        if self.cache_salt is not None:
            request.cache_salt = self.cache_salt
        return request


def streamed(request: GenerationRequest) -> GenerationRequest:
    """``request`` as a stream (a background answer's, read event by event into its log)."""
    if isinstance(request, PickledRequest):
        return dataclasses.replace(request, stream=True)
    return cast(GenerationRequest, cast(BaseModel, request).model_copy(update={"stream": True}))


def with_priority(request: GenerationRequest, priority: int) -> GenerationRequest:
    """``request`` with vLLM's scheduling ``priority`` (lower goes first among waiting requests)."""
    if isinstance(request, PickledRequest):
        return dataclasses.replace(request, priority=priority)
    request.priority = priority  # type: ignore[attr-defined]  # (vLLM's request models have it)
    return request


def with_cache_salt(request: GenerationRequest, salt: str) -> GenerationRequest:
    """``request`` with vLLM's prefix-cache ``cache_salt``: requests of different salts share no cached block."""
    if isinstance(request, PickledRequest):
        return dataclasses.replace(request, cache_salt=salt)
    request.cache_salt = salt  # type: ignore[attr-defined]  # (vLLM's request models have it)
    return request


def is_error_event(chunk: str) -> bool:
    return chunk.startswith(ERROR_EVENT_PREFIX)


def trailing_error(chunk: str) -> APIError | None:
    """The error an error event ending ``chunk`` reports (chunks are joined events), else None.

    An error event is always a stream's last event (the replica's
    :func:`serve_app.engine.stream_transforms.end_on_error_event`),
    so only the end of a chunk is looked at: one substring search per chunk.
    """
    at = chunk.rfind(ERROR_EVENT_PREFIX)
    if at < 0:
        return None
    start = at - len(ERROR_EVENT_LINE) if chunk.endswith(ERROR_EVENT_LINE, 0, at) else at
    if start > 0 and not chunk.endswith("\n\n", 0, start):
        return None
    try:
        error = json.loads(chunk[at + len("data: ") :])["error"]
        message = str(error.get("message") or "the answer failed")
        return APIError(status_of(error.get("type")), message, error.get("param"), error.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(500, "the answer failed", code=None)


def error_of(answer: WholeAnswer) -> APIError:
    """The error a whole answer's JSON body reports (OpenAI's ``{"error": ...}``), under its status."""
    try:
        error = json.loads(answer.body)["error"]
        message = str(error.get("message") or "the answer failed")
        return APIError(answer.status, message, error.get("param"), error.get("code") or answer.code)
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(answer.status, "the answer failed", code=answer.code)
