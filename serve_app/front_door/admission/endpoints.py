"""The generation endpoints: each one's HTTP path, vLLM request model and engine method. Runs in each model replica.

One table for the HTTP routes, the gRPC service and the metrics' labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel


@dataclass(frozen=True)
class Endpoint:
    """A generation endpoint: its HTTP path, its vLLM request model and the replica method that answers it."""

    path: str
    request_model: type[BaseModel]
    method: str


def default_endpoints() -> list[Endpoint]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return [
        Endpoint("/v1/chat/completions", ChatCompletionRequest, "chat"),
        Endpoint("/v1/completions", CompletionRequest, "completion"),
        Endpoint("/v1/responses", ResponsesRequest, "responses"),
    ]
