"""gRPC calls as the tests make them: a channel to one application, a stream read whole (its
responses, status and trailing metadata)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc


def _with_application(details: Any, name: str) -> Any:
    """The call's details with ``application: <name>`` added to its metadata: with several
    applications on a cluster, Serve's gRPC proxy routes by it (a one-application cluster needs none)."""
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), ("application", name)))


class _UnaryToApplication(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, name: str) -> None:
        self.name = name

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_application(details, self.name), request)


class _StreamToApplication(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, name: str) -> None:
        self.name = name

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_application(details, self.name), request)


class _StreamsToApplication(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, name: str) -> None:
        self.name = name

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_application(details, self.name), requests)


def channel(app: Any) -> grpc.aio.Channel:
    """A channel to Serve's gRPC proxy whose every call goes to ``app`` (a :class:`RunningApp`).

    (grpc.aio files an interceptor under its first kind only: one each.)
    """
    kinds = (_UnaryToApplication, _StreamToApplication, _StreamsToApplication)
    return grpc.aio.insecure_channel(app.grpc_target, interceptors=[kind(app.name) for kind in kinds])


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
