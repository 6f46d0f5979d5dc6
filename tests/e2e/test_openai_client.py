"""The official openai client works unchanged against the server."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def exactly(tokens: int) -> dict:
    """Generate exactly this many tokens: GLM-4's stop tokens are masked until then."""
    return {"min_tokens": tokens}


@pytest.fixture(scope="module")
def sync_client(app):
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
async def async_client(app):
    async with openai.AsyncOpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_sync_chat(app, sync_client):
    answer = sync_client.chat.completions.create(
        model=app.model, messages=MESSAGES, max_tokens=6, extra_body=exactly(6)
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 6


def test_sync_chat_stream(app, sync_client):
    stream = sync_client.chat.completions.create(
        model=app.model,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=exactly(6),
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


def test_sync_completion(app, sync_client):
    answer = sync_client.completions.create(model=app.model, prompt="Hello", max_tokens=4, extra_body=exactly(4))
    assert answer.usage.completion_tokens == 4


def test_sync_models(app, sync_client):
    assert [m.id for m in sync_client.models.list()] == [app.model]


def test_sync_errors_raise_the_sdk_exceptions(app, sync_client):
    with pytest.raises(openai.NotFoundError):
        sync_client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        sync_client.chat.completions.create(model=app.model, messages=MESSAGES, max_tokens=10**6)
    assert info.value.body["param"] == "max_tokens"


async def test_async_chat(app, async_client):
    answer = await async_client.chat.completions.create(
        model=app.model, messages=MESSAGES, max_tokens=6, extra_body=exactly(6)
    )
    assert answer.usage.completion_tokens == 6


async def test_async_chat_stream(app, async_client):
    stream = await async_client.chat.completions.create(
        model=app.model,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=exactly(6),
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage.completion_tokens == 6


async def test_async_completion_stream(app, async_client):
    stream = await async_client.completions.create(
        model=app.model, prompt="Hello", max_tokens=4, stream=True, extra_body=exactly(4)
    )
    chunks = [chunk async for chunk in stream]
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
