"""Requests that arrive together are batched, complete in full and never share an id.

The failure this guards against: the first request answers and the others come
back empty or one at a time (a server that serialises, or reuses request ids).
That they ran together is read from the engine's own metrics: a step of more
tokens than one request can make. Not from the order in which the streams' pieces
reached the client: on 2 cores the engine fills, the proxy can fall behind and then
write out one stream's backlog after another's, so streams generated together
arrived one after another in a CI run.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.harness.sse import post_stream
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, Samples, scrape, settled, total
from tests.waiting import wait_until

CONCURRENCY = 64
MAX_TOKENS = 32
ITERATION_TOKENS = "ray_vllm_iteration_tokens_total"  # vLLM's tokens computed per engine step
SHARED_STEP_TOKENS = 32  # a bucket bound of that histogram


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


async def test_concurrent_streams_and_unary_requests_each_deliver_every_token(app, client, metrics_url):
    """Half of them streamed, half unary, all sent at once: each delivers every token under its own
    id; the engine computed them in shared steps."""
    before = await settled(metrics_url, f"{ITERATION_TOKENS}_count")
    body = chat_body(app.model, stream=True, stream_options={"include_usage": True})
    streaming = [post_stream(client, "/v1/chat/completions", body) for _ in range(CONCURRENCY // 2)]
    unary = [client.post("/v1/chat/completions", json=chat_body(app.model)) for _ in range(CONCURRENCY // 2)]
    results = await asyncio.gather(*streaming, *unary)
    streams, responses = results[: CONCURRENCY // 2], results[CONCURRENCY // 2 :]

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
    for response in responses:
        assert response.status_code == 200, response.text
        answer = response.json()
        ids.add(answer["id"])
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["content"]) == MAX_TOKENS
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(ids) == CONCURRENCY, "no two responses share an id"
    await served_together(metrics_url, before, prompt_tokens=responses[0].json()["usage"]["prompt_tokens"])


async def served_together(metrics_url: str, before: Samples, prompt_tokens: int) -> None:
    """The engine made a step of more tokens than one request's prompt plus one since ``before``.

    Only several requests sharing a step make one: a server running one request at a
    time never does.
    """
    assert prompt_tokens + 1 <= SHARED_STEP_TOKENS, prompt_tokens  # (else a lone request's step would count)
    await wait_until(
        lambda: steps_over(scrape(metrics_url), SHARED_STEP_TOKENS) > steps_over(before, SHARED_STEP_TOKENS),
        60,
        f"an engine step of more than {SHARED_STEP_TOKENS} tokens",
        every_s=SCRAPE_EVERY_S,
    )


def steps_over(samples: Samples, tokens: int) -> float:
    """Engine steps (vLLM's iteration_tokens histogram) that computed more than ``tokens`` tokens."""
    return total(samples, f"{ITERATION_TOKENS}_count") - total(samples, f"{ITERATION_TOKENS}_bucket", le=f"{tokens}.0")
