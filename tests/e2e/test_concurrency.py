"""Requests that arrive together are batched, complete in full and never share an id.

The failure this guards against: the first request answers and the others come
back empty or one at a time (a server that serialises, or reuses request ids).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.sse import post_stream

CONCURRENCY = 64
MAX_TOKENS = 32


def chat_body(model: str, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": MAX_TOKENS,
        "min_tokens": MAX_TOKENS,  # GLM-4's stop tokens cannot end it early
        "logprobs": True,
        **extra,
    }


@pytest.fixture
async def client(app):
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=app.url, timeout=300, limits=limits) as client:
        yield client


async def test_concurrent_streams_each_deliver_every_token(app, client):
    body = chat_body(app.model, stream=True, stream_options={"include_usage": True})
    streams = await asyncio.gather(*(post_stream(client, "/v1/chat/completions", body) for _ in range(CONCURRENCY)))

    ids = set()
    for stream in streams:
        assert stream.status == 200
        assert stream.done
        chunks = stream.chunks
        stream_ids = {chunk["id"] for chunk in chunks}
        assert len(stream_ids) == 1, "every chunk of one stream carries the same id"
        ids |= stream_ids
        # Every generated token reaches the client: one logprobs entry per token.
        streamed_tokens = sum(
            len(choice["logprobs"]["content"])
            for chunk in chunks
            for choice in chunk["choices"]
            if choice.get("logprobs")
        )
        assert streamed_tokens == MAX_TOKENS
        finish = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
        assert finish == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(ids) == CONCURRENCY, "no two responses share an id"


async def test_concurrent_unary_requests_each_complete(app, client):
    body = chat_body(app.model)
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(CONCURRENCY)))
    ids = set()
    for response in responses:
        assert response.status_code == 200, response.text
        answer = response.json()
        ids.add(answer["id"])
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["content"]) == MAX_TOKENS
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(ids) == CONCURRENCY, "no two responses share an id"
