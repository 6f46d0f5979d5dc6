"""gRPC calls as the tests make them: a channel to one application, a stream read whole (its
responses, status and trailing metadata)."""

from __future__ import annotations

import asyncio
import contextlib
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


# What grpc's asyncio client reports, in place of the server's status, when one of its writes fails
# because the server has already ended the call (grpc/aio/_call.py ``_write`` calls
# ``set_internal_error``). With an interceptor the write runs in grpc's own task, which swallows
# the error, so the call ends with this status. The server never sends these details.
CLIENT_LOST_STATUS = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def refused_as(code: grpc.StatusCode, details: str, refusal: grpc.StatusCode) -> bool:
    """A call the server refused (with ``refusal``) while the client was still writing to it:
    the client reads either the refusal or grpc's own lost-status INTERNAL, never anything else."""
    return code == refusal or (code, details) == CLIENT_LOST_STATUS


class Multiplexed:
    """One Stream call (glm4serve.v1.Generation/Stream) as a test drives it: requests sent when the
    test says, every response read as it comes and filed under its request's id."""

    def __init__(self, stub: Any, **kwargs: Any) -> None:
        self.call = stub.Stream(**kwargs)
        self.responses: list[Any] = []  # in the order they came, every id's
        self._final: dict[str, asyncio.Event] = {}
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in self.call:
                self.responses.append(response)
                kind = response.WhichOneof("response")
                if kind != "rejected" and getattr(response, kind).final:
                    self._final.setdefault(response.id, asyncio.Event()).set()

    async def send(self, request: Any) -> None:
        """Send one message; one sent after the server ended the call is dropped (the status says why)."""
        with contextlib.suppress(asyncio.InvalidStateError):
            await self.call.write(request)

    def of(self, stream_id: str) -> list[Any]:
        """The responses of request ``stream_id``, unwrapped (chat or completion), in order (rejected
        messages under that id apart: :attr:`responses` holds them)."""
        kinds = [(r, r.WhichOneof("response")) for r in self.responses if r.id == stream_id]
        return [getattr(r, kind) for r, kind in kinds if kind != "rejected"]

    async def ended(self, stream_id: str, within_s: float = 60) -> Any:
        """Request ``stream_id``'s final response, once it came."""
        await asyncio.wait_for(self._final.setdefault(stream_id, asyncio.Event()).wait(), within_s)
        return self.of(stream_id)[-1]

    async def status(self) -> tuple[grpc.StatusCode, str]:
        """The call's status once the server ended it (nothing is half-closed)."""
        await self._reading
        return await self.call.code(), await self.call.details()

    async def close(self) -> tuple[grpc.StatusCode, str]:
        """Half-close (no more requests), then the call's status once it ended."""
        with contextlib.suppress(asyncio.InvalidStateError):
            await self.call.done_writing()
        await self._reading
        return await self.call.code(), await self.call.details()
