"""RequestRecord: what one generation request did, filled in as it happens.

Each door opens a record as a generation request arrives (the HTTP door's middleware,
:mod:`serve_app.front_door.http_api.middleware`; the gRPC door per call, or per request on a
Stream call) and ends it when its last byte is written or its client leaves; in between,
admission and the answer fill in the model, the request id, the outcome the engine reported and
any error. When the record ends, the same facts become the metrics, the request's log line and
its span attributes, so the three never disagree. A record only records: what a request holds
(its places, its key's lease) is its permit's (:mod:`serve_app.front_door.core.permit`).

Runs in each model replica.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app.errors import grpc_status
from serve_app.protocol import Outcome

# A build's outcomes (the metrics' label): built, or the code of the 400 it gave.
GRAMMAR_BUILT = "built"
GRAMMAR_TOO_COSTLY = "grammar_too_costly"  # past ingress.max_grammar_build_s
INVALID_GRAMMAR = "invalid_grammar"  # the engine could not build it
GRAMMAR_OUTCOMES = (GRAMMAR_BUILT, GRAMMAR_TOO_COSTLY, INVALID_GRAMMAR)

CLIENT_GONE = 499  # the status logged and counted for a request whose client left (nginx's convention)


class Phase(enum.Enum):
    RECEIVED = "received"  # being read, validated, routed
    QUEUED = "queued"  # sent to a model replica, no first token yet
    RUNNING = "running"  # the answer is being written
    ENDED = "ended"


@dataclass(eq=False)
class RequestRecord:
    endpoint: str  # "chat" or "completion"
    protocol: str = "http"  # or "grpc"; statuses are HTTP's either way (the gRPC service maps its own)
    rpc: str = ""  # the gRPC method that brought it (ChatCompletion, Completion, Stream); "" for HTTP
    stream_id: str = ""  # on a multiplexed gRPC call (Stream), the id its client gave it
    started_at: float = field(default_factory=time.monotonic)
    model: str | None = None  # set once routed; never a client's unknown model name
    request_id: str | None = None
    key_id: str | None = None  # hashed API key, when keys are configured
    stream: bool = False
    phase: Phase = Phase.RECEIVED
    status: int | None = None
    error_code: str | None = None
    attempts: int = 0  # calls made to model replicas: more than 1 means it was sent again
    keepalives: int = 0  # SSE comments sent while the answer had not begun (core.stream_watch)
    grammar_build: str | None = None  # its grammar's build: grammar_build.GRAMMAR_BUILT, or its 400's code
    first_byte_at: float | None = None
    ended_at: float | None = None
    completed: bool = False  # the last byte was written
    outcome: Outcome | None = None
    span: Any = None
    on_phase: Callable[[RequestRecord, Phase, Phase], None] | None = None
    # Only when content logging is on: the request's body and the answer's bytes.
    log_content: bool = False
    request_body: dict[str, Any] | None = None
    response_bytes: list[bytes] = field(default_factory=list)

    def enter(self, phase: Phase) -> None:
        old, self.phase = self.phase, phase
        if self.on_phase is not None and self.model is not None and old is not phase:
            self.on_phase(self, old, phase)

    def failed(self, status: int, code: str | None) -> None:
        """The answer is an error (before or during the stream)."""
        self.status, self.error_code = status, code

    @property
    def aborted(self) -> bool:
        return self.status == CLIENT_GONE

    @property
    def finish_reason(self) -> str | None:
        reasons = self.outcome.finish_reasons if self.outcome else ()
        return reasons[0] if reasons else None

    @property
    def ttft_s(self) -> float | None:
        """Streams only: a whole answer's first byte is its last token."""
        if not self.stream or self.first_byte_at is None:
            return None
        return self.first_byte_at - self.started_at

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.started_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM defines it; None with fewer than two tokens."""
        tokens = self.outcome.completion_tokens if self.outcome else 0
        started = self.first_byte_at if self.stream else None  # when ttft_s is known
        if tokens < 2 or started is None or self.ended_at is None or not self.completed:
            return None
        return (self.ended_at - started) / (tokens - 1)


Observer = Callable[[RequestRecord], None]


class RequestObserver(Protocol):
    """Told of each request as it moves between phases and when it ends (ServingMetrics)."""

    def moved(self, record: RequestRecord, old: Phase, new: Phase) -> None: ...

    def ended(self, record: RequestRecord) -> None: ...


def end_record(record: RequestRecord, observers: list[Observer]) -> None:
    """Close ``record``: an answer that never finished is a client that left; tell ``observers``; end its span."""
    record.ended_at = time.monotonic()
    if not record.completed and record.status != 500:
        record.status = CLIENT_GONE
    record.enter(Phase.ENDED)
    for observe in observers:
        observe(record)
    close_span(record)


def close_span(record: RequestRecord) -> None:
    """End the front door's span with the request's facts as attributes (OpenTelemetry's names where they exist)."""
    from opentelemetry.trace import Status, StatusCode

    span = record.span
    if span is None or not span.is_recording():
        return
    attributes: dict[str, Any] = {"llm.stream": record.stream}
    if record.protocol == "grpc":
        attributes["rpc.grpc.status_code"] = grpc_status(record.status or 500).value[0]
    else:
        attributes["http.response.status_code"] = record.status or 0
    optional: dict[str, Any] = {
        "gen_ai.request.model": record.model,
        "gen_ai.response.id": record.request_id,
        "llm.time_to_first_token_s": record.ttft_s,
        "error.type": record.error_code,
    }
    if record.outcome is not None:
        optional["gen_ai.usage.input_tokens"] = record.outcome.prompt_tokens
        optional["gen_ai.usage.output_tokens"] = record.outcome.completion_tokens
        optional["gen_ai.response.finish_reasons"] = list(record.outcome.finish_reasons)
    attributes |= {name: value for name, value in optional.items() if value is not None}
    span.set_attributes(attributes)
    if record.status is not None and record.status >= 500 and not record.aborted:
        span.set_status(Status(StatusCode.ERROR, record.error_code or str(record.status)))
    span.end()
