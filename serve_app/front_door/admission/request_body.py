"""A generation request's body as admission reads it, whichever door brought it. Runs in each model replica.

The HTTP door hands admission the bytes it read (:class:`JSONBody`); the gRPC door the message
it already has (:class:`serve_app.front_door.grpc_api.messages.MessageBody`), which becomes the
HTTP API's JSON without being serialized and parsed again. Only a large body crosses to the
checker process as bytes (:mod:`serve_app.front_door.admission.large_bodies`), with the picklable
function that turns them into that JSON there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve_app.front_door.admission.large_bodies import ToJSON


class RequestBody(Protocol):
    """A request's body: its size on the wire, and the HTTP API's JSON it stands for."""

    @property
    def size(self) -> int:
        """Its bytes as the client sent them: what the body limit and the large-body rule count."""
        ...

    def json(self) -> bytes:
        """The HTTP API's JSON body, which admission decodes and validates."""
        ...

    def for_checker(self) -> tuple[bytes, ToJSON | None]:
        """What crosses to the checker process: bytes, and how they become that JSON there (None: they are it)."""
        ...


@dataclass(frozen=True)
class JSONBody:
    """An HTTP request's body: JSON bytes as read."""

    raw: bytes

    @property
    def size(self) -> int:
        return len(self.raw)

    def json(self) -> bytes:
        return self.raw

    def for_checker(self) -> tuple[bytes, ToJSON | None]:
        return self.raw, None
