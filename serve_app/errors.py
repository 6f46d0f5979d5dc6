"""OpenAI-shaped errors, and the gRPC status of each.

Every non-2xx answer, and every error event that ends a stream, carries the body
OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``. The
``type`` follows the OpenAI API's names for the status, so an SDK raises the
exception class its users already catch. The gRPC API answers the same cases
with the status :func:`grpc_status` names.

Runs in each model replica (its front door and its engine) and each ReplicaPicker replica.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import grpc

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# The gRPC status that answers each HTTP status, as gRPC's own HTTP mapping and Google's API design guide pair them.
_GRPC_BY_STATUS = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.INVALID_ARGUMENT,  # the request is too large: sending it again will not help
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_status(status: int) -> grpc.StatusCode:
    """The gRPC status of an HTTP status: other 4xx are INVALID_ARGUMENT, other 5xx INTERNAL."""
    if status in _GRPC_BY_STATUS:
        return _GRPC_BY_STATUS[status]
    return grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL


UNAVAILABLE = "unavailable"
"""The ``code`` of a refusal before any engine saw the request: safe to send again."""
ENGINE_FAILED = "engine_failed"
"""The ``code`` of an answer whose engine died while generating it (never retried)."""
STREAM_STALLED = "stream_stalled"
"""The ``code`` of a stream that got no token for ``ingress.stream_stall_timeout_s`` while its replica's others did."""

QUOTED_INPUT_CHARS = 100


def quoted(value: str, limit: int = QUOTED_INPUT_CHARS) -> str:
    """Client input as an error message quotes it: at most ``limit`` characters, then an ellipsis.

    A message must not grow with what a client sends (a 1 MB model name would
    come back, and be logged, whole).
    """
    return value if len(value) <= limit else value[:limit] + "…"


def error_type(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if status < 500 else "internal_error"


# For a type several statuses share, the one it most often stands for.
_STATUS_BY_TYPE = {name: status for status, name in _TYPE_BY_STATUS.items()} | {
    "invalid_request_error": 400,
    "timeout_error": 504,
}


def status_of(error_type_name: str | None) -> int:
    """The status an error ``type`` stands for; 500 for a type this server does not send."""
    return _STATUS_BY_TYPE.get(error_type_name or "", 500)


@dataclass(eq=False)  # exceptions must stay hashable and mutable (tracebacks, causes)
class APIError(Exception):
    """An error with its HTTP status, raised anywhere and rendered once, at the edge."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def to_json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def __str__(self) -> str:
        return f"{self.status} {HTTPStatus(self.status).phrase}: {self.message}"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """The final event of a stream that failed after it started."""
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"


def responses_error_event(status: int, message: str, code: str | None = None, sequence_number: int = 0) -> bytes:
    """The final event of a Responses API stream that failed after it started: OpenAI's ``error``
    event (``type``, ``code``, ``message``, ``param``, ``sequence_number``) that also carries the
    error object under ``error`` first, as every other stream's error event does (and as
    :func:`serve_app.protocol.trailing_error` and the OpenAI SDKs read it)."""
    error = error_body(status, message, code=code)
    event = error | {"type": "error", "code": code, "message": message, "param": None}
    return b"event: error\ndata: " + json.dumps(event | {"sequence_number": sequence_number}).encode() + b"\n\n"


def overloaded() -> APIError:
    """The 429 for a request that its replica can neither take nor queue now (the replica's own count)."""
    return APIError(429, "the model is overloaded; retry shortly", code="overloaded", headers={"Retry-After": "1"})
