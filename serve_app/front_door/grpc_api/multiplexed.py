"""One gRPC call carrying many requests (``glm4serve.v1.Generation/Stream``), as Triton's decoupled
``ModelStreamInfer`` does: the client sends requests, each under an id it chose, and cancels of
earlier ids; every request runs at once with the others, and its responses come back interleaved
with the others', each tagged with its id, the last one ``final``.

:class:`MultiplexedCall` reads the call's messages in a task of its own and runs each request in
another (what a request is and how it is answered, the service's :class:`RequestRunner` says:
the same admission and pipeline as a call of its own). Every response goes through one
buffer that the call's writer empties; at most ``max_buffered_responses`` wait in it, and a
request with a response to write past that waits (and so does the reader, which stops taking
new messages: gRPC's flow control then holds the client back). A request has at most one
response in the buffer and reads its next only once the writer took it, as a call of its own
waits for each write: meanwhile vLLM merges the tokens it makes into one output, so a busy call
writes fewer, fuller responses (read at once, every token was a response). At most
``max_requests_at_once`` run; one more is answered RESOURCE_EXHAUSTED alone.

The call ends once the client half-closed and every request's final response was written.
A call the client cancels (or whose connection drops) cancels every request it runs, which
aborts them in the engine. A call with no request running and no message from its client for
``idle_timeout_s`` is ended (:attr:`MultiplexedCall.idled` says why: the service ends it
UNAVAILABLE), so an idle call does not hold its place for ever.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

from google.protobuf.message import Message

from serve_app.config import GRPCStreamConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.echoed import MAX_ID_CHARS
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.messages import error_message

logger = logging.getLogger("ray.serve")

CANCELLED_BY_CLIENT = APIError(499, "the request was cancelled on its stream", code="cancelled")


class RequestRunner(Protocol):
    """How one request of a multiplexed call is answered (the service, with the call's metadata)."""

    def run(self, kind: str, request: Message, stream_id: str, store: bool) -> AsyncGenerator[pb.StreamResponse, None]:
        """The request's responses, the last one ``final`` (a refusal is a final response alone)."""
        ...

    def refuse(self, kind: str, request: Message, stream_id: str, error: APIError) -> pb.StreamResponse:
        """A final response refusing the request, counted and logged as a request refused."""
        ...

    def final(self, kind: str, request: Message, stream_id: str, index: int, error: APIError) -> pb.StreamResponse:
        """A final response with ``error``, nothing counted (the request's own record counts it)."""
        ...

    async def cancel(self, stream_id: str) -> bool:
        """Stop a kept request wherever it is generated (its final comes through its log); False if
        the request is not kept, for the call to cancel itself."""
        ...


class MultiplexedCall:
    """The state of one Stream call: its running requests and its buffer of responses."""

    def __init__(self, runner: RequestRunner, limits: GRPCStreamConfig) -> None:
        self.runner = runner
        self.limits = limits
        self._running: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[asyncio.Task[None]] = set()
        # (a response, and what to tell once the writer took it; None ends the call)
        self._buffer: asyncio.Queue[tuple[pb.StreamResponse, asyncio.Event | None] | None] = asyncio.Queue()
        self._space = asyncio.Semaphore(limits.max_buffered_responses)
        self._reading = True
        self._heard = asyncio.Event()  # set by each message and each request's end: the call is not idle
        self.idled: str | None = None  # why the call was ended idle (None: it was not)

    async def responses(self, requests: AsyncIterator[pb.StreamRequest]) -> AsyncGenerator[pb.StreamResponse, None]:
        """The call's responses, as they come, until the client half-closed and every request ended."""
        reader = asyncio.create_task(self._read(requests), name="stream reader")
        watch = asyncio.create_task(self._end_when_idle(), name="stream idle watch")
        try:
            while (buffered := await self._buffer.get()) is not None:
                self._space.release()
                response, taken = buffered
                yield response
                if taken is not None:
                    taken.set()
        finally:  # ended, or the call was cancelled: nothing of it runs on
            tasks = [reader, watch, *self._running.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _end_when_idle(self) -> None:
        """End the call once no request runs and its client has sent nothing for ``idle_timeout_s``."""
        idle_s = self.limits.idle_timeout_s
        while True:
            self._heard.clear()
            try:
                async with asyncio.timeout(idle_s):  # (not wait_for: in 3.11 it can swallow the call's cancel)
                    await self._heard.wait()
            except TimeoutError:
                if not self._running:
                    self.idled = f"the call was idle for {idle_s:g} s (no request running, no message); open a new call"
                    self._buffer.put_nowait(None)
                    return

    async def _read(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        try:
            async for message in requests:
                self._heard.set()
                await self._take(message)
        except Exception:
            logger.exception("a Stream call's requests could not be read; its requests are cancelled")
            self._buffer.put_nowait(None)  # (the writer ends the call, which cancels what runs)
            return
        cancelled = getattr(requests, "is_cancelled", None)
        if cancelled is not None and cancelled():  # Serve's input ended because the client left
            self._buffer.put_nowait(None)
            return
        self._reading = False
        self._end_if_done()

    async def _take(self, message: pb.StreamRequest) -> None:
        """Start, cancel or reject one message's request."""
        stream_id = message.id
        which = message.WhichOneof("request")
        if not stream_id:
            await self._reject(stream_id, APIError(400, "a StreamRequest needs an id", "id"))
        elif len(stream_id) > MAX_ID_CHARS:  # (echoed cut to the bound: it would be in every response)
            too_long = APIError(400, f"a StreamRequest's id is at most {MAX_ID_CHARS} characters", "id")
            await self._reject(stream_id[:MAX_ID_CHARS], too_long)
        elif which is None:
            empty = APIError(400, "a StreamRequest carries chat, completion or cancel", "request")
            await self._reject(stream_id, empty)
        elif which == "cancel":
            task = self._running.get(stream_id)
            if task is None:
                await self._reject(
                    stream_id, APIError(404, f"no request {stream_id!r} runs on this call", "id", "unknown_id")
                )
            elif not await self.runner.cancel(stream_id):
                self._cancelling.add(task)
                task.cancel()
        elif stream_id in self._running:
            await self._reject(
                stream_id,
                APIError(409, f"request {stream_id!r} still runs on this call; ids are unique", "id", "duplicate_id"),
            )
        elif len(self._running) >= self.limits.max_requests_at_once:
            limit = self.limits.max_requests_at_once
            error = APIError(429, f"this call runs {limit} requests at once already", code="stream_limit")
            await self._emit(self.runner.refuse(which, getattr(message, which), stream_id, error))
        else:
            running = self._run(stream_id, which, getattr(message, which), message.store)
            task = asyncio.create_task(running, name=f"stream {stream_id}")
            self._running[stream_id] = task
            task.add_done_callback(lambda done: self._ended(stream_id, done))

    async def _run(self, stream_id: str, kind: str, request: Message, store: bool) -> None:
        index = 0
        writing: pb.StreamResponse | None = None  # a response not yet in the buffer
        taken = asyncio.Event()  # the writer took this request's last response
        try:
            async with contextlib.aclosing(self.runner.run(kind, request, stream_id, store)) as responses:
                async for writing in responses:
                    taken.clear()
                    await self._emit(writing, taken)
                    final = getattr(writing, kind).final
                    index, writing = index + 1, None
                    if not final:
                        await taken.wait()  # (the next is read once this one is written)
        except asyncio.CancelledError:
            if asyncio.current_task() not in self._cancelling:
                raise  # the call ended: no one reads a final response
            # Cancelled by the client (the engine's request is aborted by now): its final says so,
            # unless the answer's own final was already on its way.
            ended = writing is not None and getattr(writing, kind).final
            final = writing if ended else self.runner.final(kind, request, stream_id, index, CANCELLED_BY_CLIENT)
            assert final is not None
            await self._emit(final)

    def _ended(self, stream_id: str, task: asyncio.Task[None]) -> None:
        self._heard.set()
        if self._running.get(stream_id) is task:
            del self._running[stream_id]
        self._cancelling.discard(task)
        self._end_if_done()

    def _end_if_done(self) -> None:
        if not self._reading and not self._running:
            self._buffer.put_nowait(None)

    async def _reject(self, stream_id: str, error: APIError) -> None:
        await self._emit(pb.StreamResponse(id=stream_id, rejected=error_message(error)))

    async def _emit(self, response: pb.StreamResponse, taken: asyncio.Event | None = None) -> None:
        await self._space.acquire()
        self._buffer.put_nowait((response, taken))
