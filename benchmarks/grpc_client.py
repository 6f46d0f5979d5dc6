"""One streamed call to the gRPC API (glm4serve.v1.Generation), timed as a client sees it.

The gRPC side of :mod:`benchmarks.client`: the same :class:`~benchmarks.client.Workload`,
the same :class:`~benchmarks.records.RequestRecord`. A completions prompt is text here
(the gRPC API takes ``prompt`` as a string): compare the protocols on ``--endpoint chat``,
where both send the same text. ``grpc-stream`` sends every request of a client on one
multiplexed call (:class:`MultiplexedClients`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from benchmarks.client import Workload
from benchmarks.records import RequestRecord
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc


def request_of(workload: Workload) -> Any:
    """The workload's request as a gRPC message: exactly ``output_tokens`` tokens, greedy."""
    text = " ".join(["hello"] * workload.input_tokens)
    request: Any
    if workload.endpoint == "completions":
        request = pb.CompletionRequest(model=workload.model, prompt=text)
    else:
        request = pb.ChatCompletionRequest(model=workload.model, messages=[pb.Message(role="user", content=text)])
    request.max_tokens, request.ignore_eos, request.temperature = workload.output_tokens, True, 0.0
    return request


async def grpc_stream_once(stub: pb_grpc.GenerationStub, workload: Workload, metadata: tuple = ()) -> RequestRecord:
    started = time.perf_counter()
    call = stub.Completion if workload.endpoint == "completions" else stub.ChatCompletion
    return await timed(call(request_of(workload), metadata=metadata), started)


async def timed(responses: AsyncIterator[Any], started: float) -> RequestRecord:
    """One answer's responses (a call's, or one request's on a multiplexed call) timed as they come."""
    record = RequestRecord(ok=False)
    last_output: float | None = None
    try:
        async for response in responses:
            now = time.perf_counter()
            if response.final:
                if response.HasField("error"):
                    record.error = f"final error: {response.error.message[:120]}"
                    return record
                record.e2e_s = now - started
                record.output_tokens = response.usage.completion_tokens
                record.ok = record.ttft_s is not None
                break
            if last_output is None:
                record.ttft_s = now - started
            else:
                record.gaps_s.append(now - last_output)
            last_output = now
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"[:160]
    if record.e2e_s is None and record.error is None:
        record.error = "stream ended without a final response"
    return record


class GRPCClients:
    """One channel per call in flight, kept open between calls: as the HTTP side's one connection each."""

    def __init__(self, target: str, api_key: str | None = None, application: str | None = None) -> None:
        self.target = target
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if application:  # Serve's gRPC proxy routes by it when the cluster runs several applications
            self.metadata += (("application", application),)
        self.idle: list[tuple[grpc.aio.Channel, pb_grpc.GenerationStub]] = []
        self.all: list[grpc.aio.Channel] = []

    def acquire(self) -> tuple[grpc.aio.Channel, pb_grpc.GenerationStub]:
        if self.idle:
            return self.idle.pop()
        channel = grpc.aio.insecure_channel(self.target)
        self.all.append(channel)
        return channel, pb_grpc.GenerationStub(channel)

    def release(self, client: tuple[grpc.aio.Channel, pb_grpc.GenerationStub]) -> None:
        self.idle.append(client)

    async def stream_once(self, client: tuple[grpc.aio.Channel, pb_grpc.GenerationStub], workload: Workload) -> Any:
        return await grpc_stream_once(client[1], workload, self.metadata)

    async def aclose(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.all))


class MultiplexedCall:
    """One Stream call (glm4serve.v1.Generation/Stream) shared by many requests at once: each sent
    under an id of its own, its responses handed to it as they come."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.call = pb_grpc.GenerationStub(self.channel).Stream(metadata=metadata)
        self.waiting: dict[str, asyncio.Queue[Any]] = {}
        self.writing = asyncio.Lock()  # (one write at a time on a call)
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for response in self.call:
                kind = response.WhichOneof("response")
                answer = response.rejected if kind == "rejected" else getattr(response, kind)
                self.waiting[response.id].put_nowait(answer)
        except grpc.aio.AioRpcError as exc:
            for queue in self.waiting.values():
                queue.put_nowait(exc)

    async def answer(self, workload: Workload) -> RequestRecord:
        stream_id = str(next(self.ids))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting[stream_id] = queue
        request = request_of(workload)
        kind = "completion" if workload.endpoint == "completions" else "chat"
        started = time.perf_counter()
        async with self.writing:
            await self.call.write(pb.StreamRequest(id=stream_id, **{kind: request}))

        async def responses() -> AsyncIterator[Any]:
            while True:
                response = await queue.get()
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, pb.Error):  # the message was rejected
                    response = pb.ChatCompletionResponse(final=True, error=response)
                yield response
                if response.final:
                    return

        try:
            return await timed(responses(), started)
        finally:
            del self.waiting[stream_id]

    async def aclose(self) -> None:
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
            await self.call.done_writing()
        await self.reader
        await self.channel.close()


class MultiplexedClients:
    """``calls`` Stream calls, each carrying its share of the requests in flight (round robin): the
    same load as :class:`GRPCClients`, on one connection and call per client instead of one per
    request."""

    def __init__(self, target: str, api_key: str | None = None, application: str | None = None, calls: int = 1) -> None:
        self.target = target
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if application:
            self.metadata += (("application", application),)
        self.count = calls
        self.calls: list[MultiplexedCall] = []
        self.turn = itertools.count()

    def acquire(self) -> int:
        return next(self.turn) % self.count

    def release(self, client: int) -> None:
        pass

    async def stream_once(self, client: int, workload: Workload) -> RequestRecord:
        while len(self.calls) < self.count:
            self.calls.append(MultiplexedCall(self.target, self.metadata))
        return await self.calls[client].answer(workload)

    async def aclose(self) -> None:
        await asyncio.gather(*(call.aclose() for call in self.calls))
