"""One structured log line per generation request, written by the model replica that served it.

The line is a JSON object in the message of Ray Serve's replica logger, so it
lands in the model replica's log (``/tmp/ray/session_latest/logs/serve/`` on
a local cluster) next to Serve's own access line, and any log shipper can
parse it. Prompts and completions are left out unless
``ingress.log_content`` is on: they are the users' data. Lines of refused requests (a 4xx
other than 499) are written at a bounded rate (:class:`RefusalBudget`): a flood of requests
without a key must not turn into a flood of log lines. Their metrics count every one.

Runs in each model replica.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from serve_app.front_door.telemetry.record import RequestRecord

logger = logging.getLogger("ray.serve")


def request_fields(record: RequestRecord) -> dict[str, Any]:
    """The facts of one request, in milliseconds where they are times."""
    outcome = record.outcome
    ttft, duration = record.ttft_s, record.duration_s
    fields: dict[str, Any] = {
        "event": "request",
        "id": record.request_id,
        "model": record.model,
        "endpoint": record.endpoint,
        "protocol": record.protocol,
        "stream": record.stream,
        "status": record.status,
        "error": record.error_code,
        "attempts": record.attempts,
        "finish_reason": record.finish_reason,
        "prompt_tokens": outcome.prompt_tokens if outcome else None,
        "completion_tokens": outcome.completion_tokens if outcome else None,
        "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
        "duration_ms": round(duration * 1000, 1) if duration is not None else None,
    }
    if outcome is not None and outcome.empty is not None:
        fields["empty"] = outcome.empty  # an answer with nothing in it (docs/observability.md)
    if record.rpc:
        fields["rpc"] = record.rpc
    if record.stream_id:
        fields["stream_id"] = record.stream_id  # the client's id of a request on a multiplexed call
    if record.key_id is not None:
        fields["key_id"] = record.key_id
    if record.span is not None and record.span.get_span_context().is_valid:
        fields["trace_id"] = format(record.span.get_span_context().trace_id, "032x")
    if record.log_content:
        fields["request"] = _request_content(record.request_body)
        fields["completion"] = completion_text(b"".join(record.response_bytes), record.stream)
    return fields


@dataclass
class RefusalBudget:
    """A token bucket for refused requests' lines: ``per_s`` a second on average, ``burst`` at once.

    A line past the budget is not written but counted; the next one written says how many were
    not (``refused_lines_dropped``)."""

    per_s: float = 10.0
    burst: float = 100.0
    tokens: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)
    dropped: int = 0

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float) -> int | None:
        """None when this line is over the budget; else how many lines were dropped before it."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.per_s)
        self.updated = now
        if self.tokens < 1:
            self.dropped += 1
            return None
        self.tokens -= 1
        dropped, self.dropped = self.dropped, 0
        return dropped


_REFUSALS = RefusalBudget()  # one per process: a model replica's


def is_refusal(status: int | None) -> bool:
    """A request the front door or its engine refused (its client's doing); 499 is a client that left."""
    return status is not None and 400 <= status < 500 and status != 499


def log_request(record: RequestRecord, refusals: RefusalBudget = _REFUSALS) -> None:
    fields = request_fields(record)
    if is_refusal(record.status):
        dropped = refusals.take(time.monotonic())
        if dropped is None:
            return
        if dropped:
            fields["refused_lines_dropped"] = dropped
    logger.info(json.dumps(fields, separators=(",", ":"), ensure_ascii=False))


def _request_content(body: dict[str, Any] | None) -> Any:
    if body is None:
        return None
    return {name: body[name] for name in ("messages", "prompt", "tools") if name in body}


def completion_text(body: bytes, stream: bool) -> list[str] | None:
    """Each choice's text (or tool calls, as JSON) from a whole answer or an SSE stream."""
    texts: dict[int, list[str]] = {}
    try:
        documents = _sse_documents(body) if stream else [json.loads(body)]
    except ValueError:
        return None
    for document in documents:
        if (response := answered_response(document)) is not None:  # the Responses API's
            return [response_text(response)]
        for choice in document.get("choices") or []:
            part = choice.get("delta") or choice.get("message") or choice
            piece = part.get("content") or part.get("text") or ""
            if part.get("tool_calls"):
                piece += json.dumps(part["tool_calls"], ensure_ascii=False)
            texts.setdefault(choice.get("index", 0), []).append(piece)
    return ["".join(texts[index]) for index in sorted(texts)] or None


def answered_response(document: dict[str, Any]) -> dict[str, Any] | None:
    """The whole response of a Responses API answer: the unary body, or a stream's final event's."""
    if document.get("object") == "response":
        return document
    if document.get("type") in ("response.completed", "response.incomplete", "response.failed"):
        response = document.get("response")
        return response if isinstance(response, dict) else None
    return None


def response_text(response: dict[str, Any]) -> str:
    """A response's text, and its function calls as JSON."""
    pieces = []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            pieces += [part.get("text") or "" for part in item.get("content") or []]
        elif item.get("type") == "function_call":
            pieces.append(json.dumps({k: item.get(k) for k in ("name", "arguments")}, ensure_ascii=False))
    return "".join(pieces)


def _sse_documents(body: bytes) -> list[dict[str, Any]]:
    documents = []
    for line in body.decode("utf-8", errors="replace").splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            document = json.loads(line[len("data: ") :])
            if isinstance(document, dict):
                documents.append(document)
    return documents
