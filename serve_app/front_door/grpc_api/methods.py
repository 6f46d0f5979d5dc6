"""GenerationMethods: the gRPC API's methods, as Serve calls them on the deployment that answers clients.

Serve's gRPC proxy (or with HAProxy, the replica's own gRPC server) calls the
deployment method named as the RPC, with a copy of its context: the model replica,
which answers clients, has them. It holds a :class:`~serve_app.front_door.grpc_api.service.GenerationService`
as ``self.grpc``; these methods only hand calls to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.service import GenerationService, GRPCContext


class GenerationMethods:
    """glm4serve.v1.Generation and grpc.health.v1.Health, answered by ``self.grpc``."""

    grpc: GenerationService

    async def ChatCompletion(  # named as the RPC
        self, request: pb.ChatCompletionRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[pb.ChatCompletionResponse]:
        async for response in self.grpc.chat_completion(request, grpc_context):
            yield response

    async def Completion(
        self, request: pb.CompletionRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[pb.CompletionResponse]:
        async for response in self.grpc.completion(request, grpc_context):
            yield response

    async def Check(  # grpc.health.v1.Health
        self, request: health_pb2.HealthCheckRequest, grpc_context: GRPCContext
    ) -> health_pb2.HealthCheckResponse:
        """As ``GET /health``: SERVING only when every model has a healthy replica; NOT_FOUND for another service."""
        health = self.grpc.health(request.service)
        if health is None:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        ready, problem = health
        if not ready:
            grpc_context.set_details(problem)
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # grpc.health.v1.Health
        self, request: health_pb2.HealthCheckRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """Not offered: a watch would hold a place in the replica for as long as its client lives (probes use Check)."""
        grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        grpc_context.set_details("Watch is not offered; call Check")
        raise NotImplementedError("grpc.health.v1.Health/Watch")
        yield  # an async generator, as a server-streaming method must be
