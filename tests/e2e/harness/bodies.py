"""The requests the end-to-end tests send, built in one place: chat bodies and gRPC requests.

A test names what matters to it (how many tokens, streamed or not, the prompt) and
gets the rest as every other test does.
"""

from __future__ import annotations

from typing import Any

from serve_app.front_door.grpc_api import generation_pb2 as pb

STORY = "Tell me a long story."
LONG = 900  # tokens: seconds of generation on either engine


def chat(model: str, tokens: int | None = None, *, content: str = STORY, **extra: Any) -> dict[str, Any]:
    """A chat completion body; with ``tokens``, exactly that many (``max_tokens`` = ``min_tokens``:
    GLM-4's stop tokens cannot end it early)."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    if tokens is not None:
        body |= {"max_tokens": tokens, "min_tokens": tokens}
    return body | extra


def grpc_chat(model: str, tokens: int | None = None, *, content: str = STORY, **fields: Any) -> Any:
    """The same request for the gRPC API (``glm4serve.v1.Generation/ChatCompletion``)."""
    request = pb.ChatCompletionRequest(model=model, messages=[pb.Message(role="user", content=content)], **fields)
    if tokens is not None:
        request.max_tokens = request.min_tokens = tokens
    return request
