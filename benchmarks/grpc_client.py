"""One streamed call to the gRPC API (glm4serve.v1.Generation), timed as a client sees it.

The gRPC side of :mod:`benchmarks.client`: the same :class:`~benchmarks.client.Workload`,
the same :class:`~benchmarks.records.RequestRecord`. A completions prompt is text here
(the gRPC API takes ``prompt`` as a string): compare the protocols on ``--endpoint chat``,
where both send the same text.
"""

from __future__ import annotations

import asyncio
import time
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
    record = RequestRecord(ok=False)
    last_output: float | None = None
    call = stub.Completion if workload.endpoint == "completions" else stub.ChatCompletion
    try:
        async for response in call(request_of(workload), metadata=metadata):
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
