"""The Responses API's answers as the front door takes them, at chat's cost. Runs in each model replica.

vLLM's Responses serving answers with a ``ResponsesResponse`` or an async generator of
event objects (its own router frames them). Here each event is framed as SSE as that
router frames it (``event: <type>`` and its JSON), the answer's :class:`Outcome` is read
from the final event's response (usage, status, output items: no text is parsed), and a
failure after the stream began becomes an ``error`` event, the stream's last
(:func:`serve_app.errors.responses_error_event`). :class:`StreamBatchingEngine` gives its
generations chat's stream batching, which vLLM's Responses request has no field for.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serve_app.errors import responses_error_event
from serve_app.protocol import Outcome, empty_kind

logger = logging.getLogger("ray.serve")

FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Why an incomplete answer stopped, as chat's finish reasons name it.
INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}


def _field(value: Any, name: str) -> Any:
    """A field of a vLLM model or of its dump (vLLM puts both in its events)."""
    return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)


def response_outcome(response: Any) -> Outcome | None:
    """How a Responses answer ended, read from its ``response`` object; None without usage."""
    usage = _field(response, "usage")
    if usage is None:
        return None
    items = _field(response, "output") or []
    calls = [item for item in items if _field(item, "type") == "function_call"]
    texts = [
        _field(part, "text")
        for item in items
        if _field(item, "type") == "message"
        for part in _field(item, "content") or []
    ]
    status = _field(response, "status")
    reasons: tuple[str, ...] = ()
    if status == "completed":
        reasons = ("tool_calls",) if calls else ("stop",)
    elif status == "incomplete":
        reason = _field(_field(response, "incomplete_details"), "reason")
        reasons = (INCOMPLETE_REASONS.get(reason, reason or "length"),)
    empty = empty_kind(reasons, any(texts), bool(calls), any(_field(call, "arguments") for call in calls))
    return Outcome(int(_field(usage, "input_tokens") or 0), int(_field(usage, "output_tokens") or 0), reasons, empty)


def sse_event(event: Any) -> str:
    """One event framed as vLLM's Responses router frames it; a ``response.completed`` event whose
    response is incomplete (vLLM's last event, however the answer ended) is OpenAI's
    ``response.incomplete``."""
    if event.type == "response.completed" and _field(event.response, "status") == "incomplete":
        data = event.model_dump(mode="json", by_alias=True) | {"type": "response.incomplete"}
        return f"event: response.incomplete\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
    return f"event: {event.type}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


@dataclass(frozen=True)
class ResponseEcho:
    """What the front door did for a Responses request itself, which vLLM's serving must not act on
    here and its responses must still say: ``background`` (the front door runs it detached; vLLM's
    own would need its in-process store) and ``previous_response_id`` (the front door put that
    conversation in the input; vLLM's would look it up in its own store)."""

    background: bool = False
    previous_response_id: str | None = None

    @classmethod
    def split(cls, request: Any) -> tuple[Any, ResponseEcho | None]:
        """The request as vLLM is given it, and what to echo (None: nothing was taken out)."""
        if not request.background and request.previous_response_id is None:
            return request, None
        echo = cls(bool(request.background), request.previous_response_id)
        return request.model_copy(update={"background": False, "previous_response_id": None}), echo

    def apply(self, response: Any) -> None:
        if response is not None:
            response.background, response.previous_response_id = self.background, self.previous_response_id


@dataclass
class ResponsesStream:
    """One Responses stream: its events framed (:meth:`frames`), its outcome kept once it ends.

    ``failure``: the status, message and code of the error event a stream that breaks gets
    (the replica says whether its engine died under it).
    """

    failure: Callable[[], tuple[int, str, str | None]]
    echo: ResponseEcho | None = None
    outcome: Outcome | None = None

    async def frames(self, events: AsyncIterator[Any]) -> AsyncGenerator[str, None]:
        sequence_number = -1
        try:
            async for event in events:
                sequence_number = getattr(event, "sequence_number", sequence_number)
                if event.type == "error":  # vLLM's own error event: in this server's shape, and last
                    message, code = str(getattr(event, "message", "")), getattr(event, "code", None)
                    yield responses_error_event(500, message, code, sequence_number).decode()
                    return
                if self.echo is not None:
                    self.echo.apply(getattr(event, "response", None))
                if event.type in FINAL_EVENTS:
                    self.outcome = response_outcome(event.response)
                yield sse_event(event)
        except Exception:
            logger.exception("a Responses stream failed after it began")
            yield responses_error_event(*self.failure(), sequence_number=sequence_number + 1).decode()


class StreamBatchingEngine:
    """vLLM's engine as its Responses serving calls it, each generation given the tokens per chunk
    the engine's load asks for (``StreamBatchingConfig``), as chat's streams get them through
    their ``stream_interval``: under load a Responses stream, whose every delta is an event
    object built, framed and sent, had several times chat's messages per token. Everything
    else is the engine's."""

    def __init__(self, engine: Any, tokens_per_chunk: Callable[[int], int]) -> None:
        self._engine = engine
        self._tokens_per_chunk = tokens_per_chunk

    def generate(self, engine_input: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        if sampling_params.stream_interval is None:
            held = self._engine.get_num_unfinished_requests()
            sampling_params.stream_interval = self._tokens_per_chunk(held)
        return self._engine.generate(engine_input, sampling_params, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
