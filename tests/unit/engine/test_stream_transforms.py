"""The replica-side stream helpers: batching of waiting chunks, error events."""

import asyncio
import json

import pytest

from serve_app.engine.stream_transforms import (
    coalesce,
    end_on_error_event,
    normalize_error_event,
)
from serve_app.protocol import DONE_EVENT, Outcome


async def collect(agen):
    return [item async for item in agen]


async def from_list(items):
    for item in items:
        yield item


async def test_chunks_already_waiting_go_out_as_one():
    # A producer that never awaits between chunks: all are waiting when asked for.
    assert await collect(coalesce(from_list(["a", "b", "c"]))) == ["abc"]


async def test_an_item_that_is_not_a_chunk_goes_out_as_it_is_in_its_place():
    # (an answer read through a handle ends with its Outcome, after its last chunks)
    outcome = Outcome(3, 2, ("stop",), None)
    assert await collect(coalesce(from_list(["a", "b", outcome, "c"]))) == ["ab", outcome, "c"]


async def test_first_chunk_is_not_held_back_for_later_ones():
    release = asyncio.Event()

    async def slow_after_first():
        yield "first"
        await release.wait()
        yield "second"

    stream = coalesce(slow_after_first())
    # The first chunk arrives while the second cannot exist yet: nothing waits on a timer.
    assert await asyncio.wait_for(anext(stream), timeout=5) == "first"
    release.set()
    assert await collect(stream) == ["second"]


async def test_upstream_error_is_raised_after_the_chunks_before_it():
    async def failing():
        yield "a"
        raise RuntimeError("engine died")

    stream = coalesce(failing())
    assert await anext(stream) == "a"
    with pytest.raises(RuntimeError, match="engine died"):
        await anext(stream)


async def test_closing_the_stream_cancels_the_upstream_generator():
    cancelled = asyncio.Event()
    blocked = asyncio.Event()

    async def endless():
        yield "a"
        try:
            blocked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    stream = coalesce(endless())
    assert await anext(stream) == "a"
    await asyncio.wait_for(blocked.wait(), timeout=5)
    await stream.aclose()
    assert cancelled.is_set()


async def test_error_event_ends_the_stream_without_done():
    vllm_error = 'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
    chunks = await collect(end_on_error_event(from_list(["data: {}\n\n", vllm_error, DONE_EVENT])))
    assert chunks[0] == "data: {}\n\n"
    assert len(chunks) == 2
    event = json.loads(chunks[1].removeprefix("data: "))
    assert event == {"error": {"message": "boom", "type": "internal_error", "param": None, "code": None}}
    assert chunks[1].endswith("\n\n")


def test_unparsable_error_event_still_becomes_an_error_event():
    event = json.loads(normalize_error_event('data: {"error": nonsense').removeprefix("data: "))
    assert event["error"]["type"] == "internal_error"


def test_sse_error_event_is_one_openai_shaped_data_event():
    from serve_app.errors import sse_error_event

    event = sse_error_event(503, "the model replica is unavailable", code="unavailable")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    body = json.loads(event[len(b"data: ") :])
    assert body == {
        "error": {
            "message": "the model replica is unavailable",
            "type": "service_unavailable",
            "param": None,
            "code": "unavailable",
        }
    }


def test_unary_error_reply_is_openai_shaped():
    from serve_app.protocol import WholeAnswer

    reply = WholeAnswer.error(400, "bad max_tokens", "max_tokens")
    assert reply.status == 400
    assert json.loads(reply.body)["error"] == {
        "message": "bad max_tokens",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
