"""Streams that never hang silent (serve_app/front_door/core/stream_watch.py): the front door's HTTP app
with fake model handles (tests/unit/front_door/fakes.py) keeps a stream alive until it begins, and its
watchdog ends a stream that stalled while the replica's others went on."""

from __future__ import annotations

import asyncio
import json

import httpx

from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.core.stream_watch import KEEPALIVE, StallWatch
from serve_app.protocol import WholeAnswer
from tests.unit.front_door.fakes import CHAT, HANG, SLOW, TICK, RecordingMetrics, client_for

FIRST = 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
CHUNK = 'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
STREAM = CHAT | {"stream": True}


def events(text: str) -> list[str]:
    return [e + "\n\n" for e in text.split("\n\n") if e]


def test_a_stream_not_begun_within_the_interval_gets_keepalives_then_its_answer():
    metrics = RecordingMetrics()
    client, _ = client_for([SLOW, FIRST, CHUNK], keepalive_s=0.1, metrics=metrics)
    response = client.post("/v1/chat/completions", json=STREAM)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    sent = events(response.text)
    kept = sent[: sent.index(FIRST)]
    assert len(kept) >= 2 and set(kept) == {KEEPALIVE}  # (0.6 s of waiting, one each 0.1 s: about 5)
    assert sent[len(kept) :] == [FIRST, CHUNK]
    (record,) = metrics.records
    assert record.keepalives == len(kept) and record.status == 200
    assert record.ttft_s is not None and record.ttft_s >= 0.6  # the first token's time, not the first comment's


def test_a_stream_begun_within_the_interval_and_a_whole_answer_get_none():
    client, _ = client_for([FIRST, CHUNK], keepalive_s=0.1)
    assert events(client.post("/v1/chat/completions", json=STREAM).text) == [FIRST, CHUNK]
    whole = json.dumps({"choices": []}).encode()
    client, _ = client_for([SLOW, WholeAnswer(200, whole)], keepalive_s=0.1)
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.content == whole  # (a status waits for its answer)


def test_an_error_before_the_first_token_after_keepalives_is_one_error_event():
    refusal = WholeAnswer.error(503, "the engine is gone", code="engine_failed")
    client, _ = client_for([SLOW, refusal], keepalive_s=0.1)
    response = client.post("/v1/chat/completions", json=STREAM)
    assert response.status_code == 200
    *kept, last = events(response.text)
    assert kept and set(kept) == {KEEPALIVE}
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["code"] == "engine_failed" and error["message"] == "the engine is gone"


def test_a_first_token_deadline_after_keepalives_is_an_error_event_and_the_engine_request_ends():
    limits = TimeLimits(request_timeout_s=5, first_token_timeout_s=0.35)
    metrics = RecordingMetrics()
    client, handle = client_for([HANG], keepalive_s=0.1, limits=limits, metrics=metrics)
    *kept, last = events(client.post("/v1/chat/completions", json=STREAM).text)
    assert kept and set(kept) == {KEEPALIVE}
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "first_token_timeout"
    assert handle.last is not None and handle.last.cancelled
    assert metrics.records[0].status == 504


async def test_a_stream_that_stalls_while_another_goes_on_is_ended_and_its_engine_request_aborted():
    metrics = RecordingMetrics()
    steady = [FIRST] + [TICK, CHUNK] * 500  # a chunk every 20 ms, for as long as the test needs
    limits = TimeLimits(request_timeout_s=30, first_token_timeout_s=1)  # (without the watch: request_timeout)
    test_client, handle = client_for([FIRST, HANG], then=[steady], stall_s=0.2, limits=limits, metrics=metrics)
    transport = httpx.ASGITransport(app=test_client.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica", timeout=60) as client:
        stalled = asyncio.ensure_future(client.post("/v1/chat/completions", json=STREAM))
        while not handle.payloads:
            await asyncio.sleep(0.01)
        stalled_engine = handle.last
        going = asyncio.ensure_future(client.post("/v1/chat/completions", json=STREAM))
        stalled_text = (await stalled).text
        assert not going.done()  # (the other stream went on meanwhile)
        going.cancel()
    first, last = events(stalled_text)
    assert first == FIRST
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["code"] == "stream_stalled" and "0.2 s" in error["message"]
    assert stalled_engine is not None and stalled_engine.cancelled
    assert (504, "stream_stalled") in {(r.status, r.error_code) for r in metrics.records}


def test_a_stream_that_waits_while_no_stream_moves_is_left_to_its_deadline():
    """An engine slow for every stream (or hung: the engine's own watch) is not a stalled stream."""
    limits = TimeLimits(request_timeout_s=0.6, first_token_timeout_s=0.3)
    client, _ = client_for([FIRST, HANG], stall_s=0.1, limits=limits)
    last = events(client.post("/v1/chat/completions", json=STREAM).text)[-1]
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "request_timeout"


async def test_the_watch_ends_only_a_stream_waiting_past_its_bound_while_another_moves():
    watch = StallWatch(4.0)  # a tick each second, 4 ticks (its own task's first tick is after the test)
    stopped: list[str] = []
    waiting, reading, moving = (watch.watch(lambda n=n: stopped.append(n)) for n in "wrm")
    watch.waits(waiting)  # waits for its next chunk from tick 0
    watch.got(reading)  # got a chunk; its client is slow to read it: not waiting
    for _ in range(4):
        watch.waits(moving)
        watch.got(moving)
        assert watch.check() == []
    watch.got(moving)
    assert watch.check() == [waiting] and stopped == ["w"]
    watch.waits(reading)
    for _ in range(6):  # nobody moves: nobody is stalled
        assert watch.check() == []
    await watch.aclose()
