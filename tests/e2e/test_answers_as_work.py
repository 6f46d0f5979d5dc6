"""Answers are work for their whole life, and calls that only wait are not: on the bed's keyed
variants (tests/e2e/harness/apps.py), through Serve's HAProxy to the model replica.

- ``glm-limited`` holds each key to 2 requests at once. Its background answers past that cap
  wait ``queued`` (at most WAITING_PER_KEY of a key; past it a POST gets 429
  ``background_queue_full``), never more than 2 run at once, each runs once a place frees, and
  another key is served meanwhile.
- ``glm-keyed``'s idle Stream calls: a few hundred from one key leave ``/health`` and another
  key's chat answering; the key holds at most its open calls (``open_calls.max_per_key``) and is
  refused RESOURCE_EXHAUSTED past them; an idle call ends after ``grpc_stream.idle_timeout_s``.
- ``glm-keyed``'s autoscaler (held at one replica: apps.COUNTED) reads 60 requests on one Stream
  call, and 60 background answers, as it reads 60 plain streams.
- ``glm-keyed``: a Responses body of many input items, checked in the checker process, does not
  hold up another key's stream on the same replica (the largest gap between its chunks printed).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import httpx
import pytest

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from tests.e2e.harness.apps import COUNTED, FLOOD_KEY, IDLE_S, LIGHT_KEY, WAITING_PER_KEY
from tests.e2e.harness.bodies import chat, grpc_chat
from tests.e2e.harness.grpc_calls import Multiplexed, channel, refused_as
from tests.e2e.harness.serve_state import autoscaling_total
from tests.e2e.harness.simulation import Bed, ready_bed
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("glm-keyed", "glm-limited")

CAP = 2  # glm-limited's rate_limits.max_concurrent_requests
OPEN_CALLS_PER_KEY = 32  # ingress.open_calls.max_per_key, as shipped
ANSWERS = 60  # what the autoscaler is shown, each way


LARGE_ITEMS = 8000  # the body: 8,000 tiny input items (240 KB) held the replica's loop 0.5 s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def background(model: str, tokens: int) -> dict:
    return {"model": model, "input": "A story.", "background": True, "max_output_tokens": tokens}


@pytest.fixture
async def limited(variants) -> Bed:
    return await ready_bed(variants["glm-limited"])


@pytest.fixture
async def keyed(variants) -> Bed:
    return await ready_bed(variants["glm-keyed"])


async def test_background_answers_past_a_keys_cap_wait_queued_and_never_run_beyond_it(limited):
    """Of CAP + WAITING_PER_KEY + 3 background answers posted at once by one key, CAP run, the
    next WAITING_PER_KEY wait ``queued`` and run in turn, and the last 3 get 429
    ``background_queue_full``; the engine never holds more of that key's answers than CAP; a
    request of another key is served while they wait."""
    app = limited.app
    sent = CAP + WAITING_PER_KEY + 3
    async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
        async with limited.engines.paused():  # (what the engine holds stays put while they arrive)
            answers = await asyncio.gather(
                *(
                    client.post("/v1/responses", json=background(app.model, 64), headers=bearer(FLOOD_KEY))
                    for _ in range(sent)
                )
            )
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [200] * (CAP + WAITING_PER_KEY) + [429] * 3, [a.text for a in answers]
            refused = {a.json()["error"]["code"] for a in answers if a.status_code == 429}
            assert refused == {"background_queue_full"}
            await limited.engines.wait_until_holding(CAP)
            started = time.monotonic()
            light = asyncio.create_task(
                client.post("/v1/chat/completions", json=chat(app.model, 8), headers=bearer(LIGHT_KEY))
            )
            await limited.engines.wait_until_holding(CAP + 1)  # (the other key's request: at once)
        assert (await light).status_code == 200
        print(f"another key's answer, 8 tokens, beside the flood: {time.monotonic() - started:.3f} s")
        ids = [a.json()["id"] for a in answers if a.status_code == 200]
        assert [a.json()["status"] for a in answers if a.status_code == 200] == ["queued"] * len(ids)
        most = 0

        async def all_ended() -> bool:
            nonlocal most
            most = max(most, await limited.engines.holds())
            states = [(await client.get(f"/v1/responses/{i}", headers=bearer(FLOOD_KEY))).json()["status"] for i in ids]
            return states == ["incomplete"] * len(ids)  # (each ran to its max_output_tokens)

        await wait_until(all_ended, 60, "every background answer ran to its end", every_s=0.1)
    assert most <= CAP, f"the engine held {most} of one key's answers; its cap is {CAP}"


async def test_a_few_hundred_idle_stream_calls_of_one_key_leave_health_and_another_key_answering(keyed):
    """300 Stream calls of one key, each sending one message without an id and then idling: the key
    holds OPEN_CALLS_PER_KEY of them, the rest are refused (RESOURCE_EXHAUSTED naming the bound); meanwhile
    ``/health`` and another key's chat answer at once; each held call ends UNAVAILABLE once idle for
    IDLE_S, after which the key opens calls again."""
    app = keyed.app
    channels = [channel(app) for _ in range(10)]
    try:
        calls = []
        for n in range(300):
            stub = pb_grpc.GenerationStub(channels[n % len(channels)])
            calls.append(Multiplexed(stub, metadata=(("authorization", f"Bearer {FLOOD_KEY}"),)))
        await asyncio.gather(*(call.send(pb.StreamRequest()) for call in calls))

        async def answered_or_ended() -> bool:
            return all(call.responses or call.call.done() for call in calls)

        await wait_until(answered_or_ended, 60, "every call rejected its message or ended")
        held = [call for call in calls if not call.call.done()]
        refused = [call for call in calls if call.call.done()]
        assert len(held) == OPEN_CALLS_PER_KEY, (len(held), len(refused))
        ends = [(await call.call.code(), await call.call.details()) for call in refused]
        # Each refusal is RESOURCE_EXHAUSTED naming the bound; a client whose write raced the
        # server's end reads grpc's own lost-status INTERNAL instead (CLIENT_LOST_STATUS).
        assert all(refused_as(*end, grpc.StatusCode.RESOURCE_EXHAUSTED) for end in ends), Counter(ends)
        print(f"refused calls' statuses as the client read them: {Counter(code.name for code, _ in ends)}")
        assert any("open calls" in details for code, details in ends if code == grpc.StatusCode.RESOURCE_EXHAUSTED)
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as client:
            started = time.monotonic()
            health = await client.get("/health")
            health_s = time.monotonic() - started
            started = time.monotonic()
            light = await client.post("/v1/chat/completions", json=chat(app.model, 1), headers=bearer(LIGHT_KEY))
            light_s = time.monotonic() - started
        print(
            f"beside {len(held)} idle calls: /health {health_s * 1000:.0f} ms, a one-token chat {light_s * 1000:.0f} ms"
        )
        assert health.status_code == 200 and light.status_code == 200
        ended = await asyncio.wait_for(asyncio.gather(*(call.status() for call in held)), IDLE_S + 30)
        assert {code for code, _ in ended} == {grpc.StatusCode.UNAVAILABLE}
        assert "idle" in ended[0][1]
        again = Multiplexed(pb_grpc.GenerationStub(channels[0]), metadata=(("authorization", f"Bearer {FLOOD_KEY}"),))
        await again.send(pb.StreamRequest(id="r", chat=grpc_chat(app.model, 2)))
        final = await again.ended("r")
        assert final.usage.completion_tokens == 2
        await again.close()
    finally:
        for grpc_channel in channels:
            await grpc_channel.close()


async def test_the_autoscaler_reads_requests_on_a_stream_call_and_background_answers_as_plain_streams(keyed):
    """With the engine paused, ANSWERS plain streams, then ANSWERS requests on one Stream call, then
    ANSWERS background answers: what Serve's autoscaler reads for the replica reaches about ANSWERS
    each time (it read 1 for the call, and nothing for the background answers, when it counted calls)."""
    app, read = keyed.app, {}

    async def settles_at(way: str) -> None:
        async def near() -> float | None:
            total = await autoscaling_total(keyed.model)
            return total if total >= 0.9 * ANSWERS else None

        read[way] = await wait_until(near, 20, f"the autoscaler reading about {ANSWERS} ({way})", every_s=0.5)

    async with httpx.AsyncClient(base_url=app.url, timeout=60, limits=httpx.Limits(max_connections=200)) as client:
        async with keyed.engines.paused():
            streams = [
                asyncio.create_task(
                    client.post("/v1/chat/completions", json=chat(app.model, 4, stream=True), headers=bearer(LIGHT_KEY))
                )
                for _ in range(ANSWERS)
            ]
            await keyed.engines.wait_until_holding(ANSWERS)
            await settles_at("plain streams")
        assert [s.status_code for s in await asyncio.gather(*streams)] == [200] * ANSWERS
        await keyed.engines.wait_until_idle()
        async with channel(app) as grpc_channel:
            call = Multiplexed(
                pb_grpc.GenerationStub(grpc_channel), metadata=(("authorization", f"Bearer {LIGHT_KEY}"),)
            )
            async with keyed.engines.paused():
                for n in range(ANSWERS):
                    await call.send(pb.StreamRequest(id=f"r{n}", chat=grpc_chat(app.model, 4)))
                await keyed.engines.wait_until_holding(ANSWERS)
                await settles_at("one Stream call")
            assert (await call.close())[0] == grpc.StatusCode.OK
        await keyed.engines.wait_until_idle()
        async with keyed.engines.paused():
            posted = await asyncio.gather(
                *(
                    client.post("/v1/responses", json=background(app.model, 4), headers=bearer(LIGHT_KEY))
                    for _ in range(ANSWERS)
                )
            )
            assert [p.status_code for p in posted] == [200] * ANSWERS
            await keyed.engines.wait_until_holding(ANSWERS)
            await settles_at("background answers")
        await keyed.engines.wait_until_idle()
    target = COUNTED["target_ongoing_requests"]
    print(
        "the autoscaler read "
        + ", ".join(f"{value:.1f} for {ANSWERS} {way}" for way, value in read.items())
        + f"; at a target of {target} per replica each asks for {ANSWERS / target:.2f} replicas"
    )


async def timed_stream(
    client: httpx.AsyncClient, body: dict, headers: dict[str, str], started: asyncio.Event | None = None
) -> tuple[list[float], bool]:
    """When each of a stream's events came (``started`` set at the first), and whether it ended ``[DONE]``."""
    times, done = [], False
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                done = line == "data: [DONE]"
                if started is not None:
                    started.set()
    return times, done


def largest_gap(times: list[float]) -> float:
    return max(later - earlier for earlier, later in zip(times, times[1:], strict=False))


async def test_a_large_responses_body_does_not_stall_another_keys_stream(keyed):
    """A Responses body of LARGE_ITEMS input items, posted while another key's answer streams from the
    same replica, is answered (its items checked in the checker process, not on the replica's event
    loop) while the stream runs on; the stream's largest gap between chunks is printed, beside the
    same stream's alone. (The first such body, which may start the checker process, is sent before.)"""
    app = keyed.app
    large = {
        "model": app.model,
        "input": [{"role": "user", "content": "hi"}] * LARGE_ITEMS,
        "max_output_tokens": 1,
    }
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        started = time.monotonic()
        first = await client.post("/v1/responses", json=large, headers=bearer(FLOOD_KEY))
        first_s = time.monotonic() - started
        alone, done = await timed_stream(client, chat(app.model, 400, stream=True), bearer(LIGHT_KEY))
        assert done
        begun = asyncio.Event()
        body = chat(app.model, 1500, stream=True)  # (seconds longer than the body takes)
        stream = asyncio.create_task(timed_stream(client, body, bearer(LIGHT_KEY), begun))
        await asyncio.wait_for(begun.wait(), 30)
        posted_at = time.monotonic()
        answer = await client.post("/v1/responses", json=large, headers=bearer(FLOOD_KEY))
        answered_at = time.monotonic()
        beside, done = await stream
    assert done
    for response in (first, answer):  # GLM-4's template makes the items more tokens than the model's context
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "input", response.text
    assert beside[-1] > answered_at, "the stream ended before the body was answered: nothing was measured"
    window = [t for t in beside if t < posted_at][-1:] + [t for t in beside if posted_at <= t <= answered_at]
    window += [t for t in beside if t > answered_at][:1]
    print(
        f"a Responses body of {LARGE_ITEMS} items ({len(httpx.Request('POST', '/', json=large).content) // 1000} KB)"
        f" answered {answer.status_code} in {(answered_at - posted_at) * 1000:.0f} ms (the first in {first_s:.1f} s:"
        f" {first.json()['error']['message'][:80]!r}); another key's stream: largest gap between chunks"
        f" {largest_gap(window) * 1000:.0f} ms while it was handled, {largest_gap(alone) * 1000:.0f} ms alone"
    )
