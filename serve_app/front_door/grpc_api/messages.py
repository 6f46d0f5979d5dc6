"""Between the gRPC API's messages and the HTTP API's JSON: requests in, stream events out.

A request message becomes the JSON object the HTTP API would have received
(:func:`request_body`), so it is validated by the same code with the same
limits; the stream a replica answers with (SSE events of vLLM's chunks) becomes
response messages (:class:`ResponseWriter`). Pure functions over messages and
text: tested without a server.

Runs in each model replica.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from serve_app.errors import APIError, grpc_status, status_of
from serve_app.front_door.admission.large_bodies import ToJSON
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.protocol import DONE_EVENT, Outcome

# What the gRPC service asks every replica stream for: usage on every chunk (the token
# count so far) and a last usage chunk (the totals).
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def request_body(request: Message) -> dict[str, Any]:
    """The HTTP API's JSON body for a request message: only the fields the client set, by the same names."""
    body = _fields(request)
    choice = body.pop("tool_choice", None)
    if choice is not None:
        if "function_name" in choice:
            body["tool_choice"] = {"type": "function", "function": {"name": choice["function_name"]}}
        elif "mode" in choice:
            body["tool_choice"] = choice["mode"]
    body["stream"] = True
    body["stream_options"] = dict(STREAM_OPTIONS)
    return body


def message_json(message_type: type[Message], raw: bytes) -> bytes:
    """A serialized request message as the HTTP API's JSON body (:func:`request_body`): what the
    checker process parses and checks, as it does a large HTTP body."""
    return json.dumps(request_body(message_type.FromString(raw)), ensure_ascii=False).encode()


class MessageBody:
    """A gRPC request as admission reads it (a :class:`~serve_app.front_door.admission.request_body.RequestBody`):
    the message the call brought, turned into the HTTP API's JSON directly, never parsed back from
    bytes. It is serialized once: its size on the wire is what the body limit counts (protobuf
    computes a size by encoding), and those bytes are what a large one sends to the checker process."""

    def __init__(self, message: Message) -> None:
        self.message = message
        self._raw = message.SerializeToString()

    @property
    def size(self) -> int:
        return len(self._raw)

    def json(self) -> bytes:
        return json.dumps(request_body(self.message), ensure_ascii=False).encode()

    def for_checker(self) -> tuple[bytes, ToJSON | None]:
        return self._raw, functools.partial(message_json, type(self.message))


def _fields(message: Message) -> dict[str, Any]:
    """A message's set fields as JSON values; 64-bit integers stay numbers (protobuf's JSON makes them strings)."""
    fields: dict[str, Any] = {}
    for descriptor, value in message.ListFields():
        fields[descriptor.name] = _value(descriptor, value)
    return fields


def _value(descriptor: Any, value: Any) -> Any:
    if descriptor.message_type is None:
        return list(value) if descriptor.is_repeated else value
    if descriptor.message_type.full_name == "google.protobuf.Struct":
        return MessageToDict(value)
    if descriptor.is_repeated:
        return [_fields(item) for item in value]
    return _fields(value)


@dataclass(frozen=True)
class StreamShape:
    """How one endpoint's chunks and response messages look."""

    response: Callable[..., Any]  # the response message class
    choice: Callable[..., Any]  # its choice message class
    text_of: Callable[[dict[str, Any]], dict[str, Any]]  # a chunk's choice -> the choice message's fields


def _chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    delta = choice.get("delta") or {}
    fields: dict[str, Any] = {"content": delta.get("content") or ""}
    calls = []
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append(
            pb.ToolCallDelta(
                index=call.get("index") or 0,
                id=call.get("id") or "",
                name=function.get("name") or "",
                arguments=function.get("arguments") or "",
            )
        )
    fields["tool_calls"] = calls
    return fields


def _completion_choice(choice: dict[str, Any]) -> dict[str, Any]:
    return {"text": choice.get("text") or ""}


CHAT = StreamShape(pb.ChatCompletionResponse, pb.ChatChoice, _chat_choice)
COMPLETION = StreamShape(pb.CompletionResponse, pb.CompletionChoice, _completion_choice)
SHAPES = {"chat": CHAT, "completion": COMPLETION}  # each endpoint's messages, by the HTTP API's method


def wrap(stream_id: str, kind: str, index: int, response: Message, answer_id: str = "") -> pb.StreamResponse:
    """A chat or completion response (``kind``) as a Stream call's response of request ``stream_id``."""
    wrapped = pb.StreamResponse(id=stream_id, index=index, answer_id=answer_id)
    getattr(wrapped, kind).CopyFrom(response)
    return wrapped


def error_message(error: APIError) -> pb.Error:
    return pb.Error(
        status=grpc_status(error.status).value[0],
        code=error.code or "",
        message=error.message,
        param=error.param or "",
        http_status=error.status,
    )


def error_of_event(event: dict[str, Any]) -> APIError:
    """The :class:`APIError` an SSE error event stands for."""
    error = event.get("error") or {}
    message = str(error.get("message") or "the answer failed")
    return APIError(status_of(error.get("type")), message, error.get("param"), error.get("code"))


@dataclass
class ResponseWriter:
    """Turns one replica stream's SSE chunks into response messages, and writes the final one.

    Each chunk (one or more events, as the replica sent them) becomes at most
    one response: the text and token ids of each choice joined, tool-call pieces
    in order. The finish reasons are remembered for the final response, which
    also carries the usage, or the error that ended the stream.
    """

    shape: StreamShape
    model: str
    id: str = ""
    completion_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def response(self, chunk: str) -> tuple[Any | None, APIError | None]:
        """The response for ``chunk`` (None if it adds nothing), and the error an error event in it reports."""
        choices: dict[int, dict[str, Any]] = {}
        error = None
        for event in _events(chunk):
            if "error" in event:
                error = error_of_event(event)
                break
            self.id = self.id or event.get("id") or ""
            usage = event.get("usage")
            if usage:
                self.completion_tokens = int(usage.get("completion_tokens") or 0)
            for choice in event.get("choices") or ():
                index = int(choice.get("index") or 0)
                merged = choices.setdefault(index, {"index": index, "token_ids": []})
                for name, value in self.shape.text_of(choice).items():
                    merged[name] = merged.get(name, type(value)()) + value
                merged["token_ids"] += choice.get("token_ids") or []
                if reason := choice.get("finish_reason"):
                    merged["finish_reason"] = self.finish_reasons[index] = reason
        if not any(_adds_something(fields) for fields in choices.values()):
            return None, error
        message = self.shape.response(
            id=self.id,
            model=self.model,
            choices=[self.shape.choice(**fields) for _, fields in sorted(choices.items())],
            completion_tokens=self.completion_tokens,
        )
        return message, error

    def final(self, outcome: Outcome | None, error: APIError | None = None) -> Any:
        """The stream's last response: the finish reasons and usage, or the error."""
        message = self.shape.response(
            id=self.id,
            model=self.model,
            choices=[self.shape.choice(index=i, finish_reason=r) for i, r in sorted(self.finish_reasons.items())],
            completion_tokens=outcome.completion_tokens if outcome is not None else self.completion_tokens,
            final=True,
        )
        if outcome is not None:
            message.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=outcome.prompt_tokens,
                    completion_tokens=outcome.completion_tokens,
                    total_tokens=outcome.total_tokens,
                )
            )
        if error is not None:
            message.error.CopyFrom(error_message(error))
        return message


def _adds_something(fields: dict[str, Any]) -> bool:
    """A choice with text, tool-call pieces, token ids or a finish reason (not vLLM's role-only first delta)."""
    return any(value for name, value in fields.items() if name != "index")


def _events(chunk: str) -> list[dict[str, Any]]:
    """The JSON events of an SSE chunk (``data: {...}\\n\\n`` joined), without ``[DONE]``."""
    events = []
    for part in chunk.split("\n\n"):
        if not part.startswith("data: ") or part + "\n\n" == DONE_EVENT:
            continue
        try:
            event = json.loads(part[len("data: ") :])
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events
