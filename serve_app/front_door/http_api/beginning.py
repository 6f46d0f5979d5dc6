"""A stream's HTTP response, written as its answer begins: a status if it begins in time, keep-alives if not.

A stream request's handler returns :class:`BeginningStream` at once; Starlette awaits it in the
request's own task, where it waits for the answer's first item (:meth:`Generation.start`). If that
comes within ``ingress.sse_keepalive_s``, the response is what it always was: an error's status,
or SSE from the first chunk. If not, a timer starts one task that sends the response's headers
(200, ``text/event-stream``) and an SSE comment every ``sse_keepalive_s``
(:data:`~serve_app.front_door.core.stream_watch.KEEPALIVE`), so that proxies and clients that cut
an idle connection keep it; once the answer begins, that task stops and the stream goes on (an
error before the first token then comes as one error event). Nothing of this runs for a stream
that begins in time: a timer armed and cancelled, no task, no extra turn of the event loop.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from ray.exceptions import TaskCancelledError
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from serve_app.errors import APIError
from serve_app.front_door.core.generation import Generation, call_failure
from serve_app.front_door.core.stream_watch import KEEPALIVE
from serve_app.protocol import WholeAnswer, error_of

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(frames: AsyncIterator[str | bytes]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


class Keepalives:
    """After ``every_s``, the response's SSE headers and a comment every ``every_s``, from a task of
    their own, until :meth:`stop`. ``sent``: how many comments went out."""

    def __init__(self, send: Send, every_s: float) -> None:
        self._send, self._every_s = send, every_s
        self._timer = asyncio.get_running_loop().call_later(every_s, self._begin)
        self._task: asyncio.Task | None = None
        self._headers_sent = False
        self.sent = 0

    def _begin(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._send_forever(), name="keepalives")

    async def _send_forever(self) -> None:
        headers = sse_response(_nothing()).raw_headers
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        self._headers_sent = True
        while True:
            await self._send({"type": "http.response.body", "body": KEEPALIVE.encode(), "more_body": True})
            self.sent += 1
            await asyncio.sleep(self._every_s)

    async def stop(self) -> bool:
        """Stop sending; whether the response's headers went out (then the rest is this stream's body)."""
        self._timer.cancel()
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.wait((task,))  # (it is not awaited: its cancellation is not raised here)
            if not task.cancelled():
                task.exception()  # (retrieved: a send to a client that left; Serve ends the request)
        return self._headers_sent


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


class BeginningStream:
    """A stream request's response (the module's docstring): ``respond`` makes the response of an
    answer that began in time from its first item; ``frames`` are the stream's frames once it began."""

    def __init__(
        self,
        generation: Generation,
        keepalive_s: float | None,
        respond: Callable[[WholeAnswer | str], Response],
        frames: Callable[[], AsyncGenerator[str | bytes, None]],
    ) -> None:
        self.generation, self.keepalive_s = generation, keepalive_s
        self.respond, self.frames = respond, frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = self.generation
        if self.keepalive_s is None:
            await self.respond(await generation.start())(scope, receive, send)
            return
        keepalives = Keepalives(send, self.keepalive_s)
        try:
            first = await generation.start()
        except Exception as exc:
            if not await self._stop(keepalives) or isinstance(exc, TaskCancelledError):
                raise  # (the door's handlers answer it with its status; or nobody is there to read)
            await _last(send, generation.fail(exc if isinstance(exc, APIError) else call_failure(exc)))
            return
        except BaseException:  # (cancelled: the client left)
            await self._stop(keepalives)
            raise
        if not await self._stop(keepalives):
            await self.respond(first)(scope, receive, send)
            return
        if isinstance(first, WholeAnswer):  # (a stream's whole answer is an error found before any token)
            await _last(send, generation.fail(error_of(first)))
            return
        frames = self.frames()
        try:
            async for frame in frames:
                body = frame.encode() if isinstance(frame, str) else frame
                await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            await frames.aclose()  # (its generation ends with it, however the stream ends)
        await _last(send, b"")

    async def _stop(self, keepalives: Keepalives) -> bool:
        headers_sent = await keepalives.stop()
        self.generation.record.keepalives += keepalives.sent
        return headers_sent


async def _last(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": False})
