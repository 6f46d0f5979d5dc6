"""Reading a gRPC stream whole, as the gRPC tests do: its responses, status and trailing metadata."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass
class Call:
    responses: list[Any]
    code: grpc.StatusCode
    details: str
    trailing: dict[str, str]
    seconds: float = 0.0  # from sending the request to the status

    @property
    def final(self) -> Any:
        return self.responses[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.responses for c in r.choices for t in c.token_ids]


async def call(method: Any, request: Any, **kwargs: Any) -> Call:
    """Read a whole stream; its status and trailing metadata, OK or not."""
    started = time.monotonic()
    stream = method(request, **kwargs)
    responses = []
    try:
        async for response in stream:
            responses.append(response)
    except grpc.aio.AioRpcError:
        pass
    trailing = dict(await stream.trailing_metadata() or ())
    code, details = await stream.code(), await stream.details()
    return Call(responses, code, details, trailing, time.monotonic() - started)


def ends_once(result: Call) -> None:
    """Exactly one final response, and it is the last."""
    finals = [r for r in result.responses if r.final]
    assert len(finals) == 1 and result.final.final, [r.final for r in result.responses]
