"""The front door's core: a request's permit is given back exactly once, whatever its end, and an
answer generated detached holds its key's and its replica's places for its whole life, waiting
(queued, bounded per key) past its key's cap. Through the real HTTP app in this process, over a
model whose answers the test holds and releases; the real app is proven in tests/e2e."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from serve_app.config import OpenCallsConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.capacity import GenerationSlots
from serve_app.front_door.admission.large_bodies import LARGE_BODY_BYTES
from serve_app.front_door.admission.open_calls import OpenCalls
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.http_api.app import build_http_app
from tests.unit.front_door.cores import (
    ALPHA,
    BACKGROUND,
    BETA,
    CHUNK,
    MODEL,
    Answer,
    client,
    core_with,
    key,
    leases,
)
from tests.unit.front_door.fakes import CHAT, FixedReadiness
from tests.waiting import wait_until

# --- a permit's life ------------------------------------------------------------------------------


def test_a_permit_gives_back_what_it_holds_once_and_a_handed_over_one_nothing():
    slots, closed = GenerationSlots(4), []
    permit = Permit("k", None, on_close=lambda: closed.append(1))
    from serve_app.front_door.admission.capacity import SlotHold

    permit.places = SlotHold(slots, "k", slots.take(None, "k"))
    taken = permit.hand_over()
    permit.close()
    assert slots.held == 1 and closed == []  # (the one handed over holds it now)
    taken.close()
    taken.close()
    assert slots.held == 0 and closed == [1]


class Exchange:
    """One HTTP request driven straight through the ASGI app, its response read message by message,
    its client able to leave (``http.disconnect``) mid-stream: what a socket would do."""

    def __init__(self, app: Any, path: str, body: dict[str, Any], secret: str) -> None:
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.gone = asyncio.Event()
        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "scheme": "http",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {secret}".encode())],
            "client": ("127.0.0.1", 1),
            "server": ("replica", 80),
        }
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await self.gone.wait()
            return {"type": "http.disconnect"}

        self.task = asyncio.create_task(app(scope, receive, self.sent.put))

    async def status(self) -> int:
        return int((await self.sent.get())["status"])

    async def body(self) -> bytes:
        """The rest of the body, to its end."""
        parts = []
        while True:
            message = await self.sent.get()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                await self.task
                return b"".join(parts)

    async def leave(self) -> None:
        self.gone.set()
        await self.task


def app_of(core: FrontDoor) -> Any:
    return build_http_app(core, FixedReadiness(Readiness({MODEL: True}, age_s=0.1, max_age_s=30)))


@pytest.mark.parametrize("end", ["whole", "error before", "engine error", "client gone"])
async def test_a_requests_places_are_given_back_exactly_once_whatever_its_end(end):
    core, model, limiter = core_with(max_concurrent=4)
    assert core.slots is not None
    app = app_of(core)
    if end == "error before":
        refused = Exchange(app, "/v1/chat/completions", CHAT | {"temperature": 9}, ALPHA)
        assert await refused.status() == 400
        await refused.body()
    else:
        exchange = Exchange(app, "/v1/chat/completions", CHAT | {"stream": True}, ALPHA)
        assert await exchange.status() == 200
        assert (await exchange.sent.get())["body"] == CHUNK.encode()
        assert core.slots.held == 1 and leases(limiter) == 1 and core.answers() == 1
        (answer,) = model.answers
        if end == "client gone":
            await exchange.leave()
            assert answer.cancelled  # (the engine's request let go)
        else:
            if end == "engine error":
                answer.__class__ = FailingAnswer
            answer.release.set()
            rest = await exchange.body()
            assert (b'"error"' in rest) == (end == "engine error")
    assert core.slots.held == 0 and core.answers() == 0
    await asyncio.gather(*core.rules.key_limits._calls)  # (the release, sent in the background)
    assert leases(limiter) == 0 and core.slots.by_key == {}


class FailingAnswer(Answer):
    async def __anext__(self) -> Any:
        raise RuntimeError("the engine failed")


# --- background answers are work for their whole life ----------------------------------------------


async def test_a_background_answer_holds_its_requests_places_until_it_ends_not_until_its_post_returns():
    core, model, limiter = core_with(max_concurrent=4)
    assert core.slots is not None
    async with client(core) as http:
        posted = await http.post("/v1/responses", json=BACKGROUND, headers=key(ALPHA))
        assert posted.status_code == 200 and posted.json()["status"] == "queued"
        await wait_until(lambda: model.answers, 5, "the answer began")
        assert core.slots.held == 1 and leases(limiter) == 1 and core.answers() == 1
        model.answers[0].release.set()
        await wait_until(lambda: core.slots.held == 0, 5, "its place given back as it ended")
    await asyncio.gather(*core.rules.key_limits._calls)
    assert leases(limiter) == 0


async def test_a_background_body_past_256_kib_is_kept_and_run_as_a_small_one_is():
    """Checked in the checker process (its bytes past LARGE_BODY_BYTES), a background Responses body is
    kept ``queued`` with the input items a later turn continues from, and its answer runs (issue 78:
    such a body was never kept, and its ``background`` ignored)."""
    core, model, _ = core_with()
    small = json.dumps(BACKGROUND | {"input": [{"role": "user", "content": "hi"}]}).encode()
    large = small[:-1] + b" " * LARGE_BODY_BYTES + b"}"
    assert core.stored is not None
    async with client(core) as http:
        headers = key(ALPHA) | {"Content-Type": "application/json"}
        posted = await http.post("/v1/responses", content=large, headers=headers)
        assert posted.status_code == 200, posted.text
        assert (posted.json()["status"], posted.json()["background"]) == ("queued", True)
        response_id = posted.json()["id"]
        await wait_until(lambda: model.answers, 60, "the answer began")
        (item,) = await core.stored.store.input_items(response_id)
        assert (item["role"], item["content"]) == ("user", "hi")
        model.answers[0].release.set()
        await wait_until(lambda: core.slots is not None and core.slots.held == 0, 5, "the answer ended")


async def test_past_its_keys_cap_a_background_answer_waits_queued_in_order_and_never_runs_beyond_the_cap():
    """Cap 2, queue 3: of 8 posted at once, 2 run, 3 wait `queued`, 3 get 429 background_queue_full;
    another key is served meanwhile; each waiting one runs as a place frees, never more than 2 at once."""
    core, model, limiter = core_with(max_concurrent=2, max_waiting=3)
    async with client(core) as http:
        posted = await asyncio.gather(
            *(http.post("/v1/responses", json=BACKGROUND, headers=key(ALPHA)) for _ in range(8))
        )
        statuses = sorted(p.status_code for p in posted)
        assert statuses == [200] * 5 + [429] * 3
        assert {p.json()["error"]["code"] for p in posted if p.status_code == 429} == {"background_queue_full"}
        await wait_until(lambda: len(model.answers) == 2, 5, "two running")
        assert core.stored is not None and core.stored.background.waiting == 3
        other = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT, headers=key(BETA)))
        await wait_until(lambda: len(model.answers) == 3, 5, "another key's request served at once")
        model.answers[2].release.set()
        assert (await other).status_code == 200
        assert core.stored.background.waiting == 3 and len(model.running()) == 2
        running_at_most = 0
        while len(model.answers) < 6 or model.running():
            running_at_most = max(running_at_most, len(model.running()))
            if model.running():
                model.running()[0].release.set()
            await asyncio.sleep(0.01)
        assert running_at_most == 2 and len(model.answers) == 6
        ids = [p.json()["id"] for p in posted if p.status_code == 200]
        for answer_id in ids:
            final = await wait_until(lambda i=answer_id: _status(http, i, "completed"), 10, f"{answer_id} completed")
            assert final
    await asyncio.gather(*core.rules.key_limits._calls)
    assert leases(limiter) == 0 and core.answers() == 0


async def _status(http: httpx.AsyncClient, answer_id: str, status: str) -> bool:
    response = await http.get(f"/v1/responses/{answer_id}", headers=key(ALPHA))
    return response.json().get("status") == status


async def test_a_burst_of_background_answers_passes_the_replicas_bound_by_none():
    core, model, _ = core_with(background_limit=3)
    async with client(core) as http:
        posted = await asyncio.gather(
            *(http.post("/v1/responses", json=BACKGROUND, headers=key(ALPHA)) for _ in range(10))
        )
        assert sorted(p.status_code for p in posted) == [200] * 3 + [429] * 7
        for answer in model.answers:
            answer.release.set()


async def test_a_stopping_replica_ends_its_waiting_answers_replica_stopped_and_finishes_its_running_ones():
    core, model, _ = core_with(max_concurrent=1, max_waiting=2)
    assert core.stored is not None
    async with client(core) as http:
        running = await http.post("/v1/responses", json=BACKGROUND, headers=key(ALPHA))
        waiting = await http.post("/v1/responses", json=BACKGROUND, headers=key(ALPHA))
        await wait_until(lambda: model.answers and core.stored.background.waiting == 1, 5, "one runs, one waits")
        draining = asyncio.create_task(core.stored.background.drain())
        await wait_until(lambda: core.stored.background.waiting == 0, 5, "the waiting one ended")
        model.answers[0].release.set()
        await asyncio.wait_for(draining, 10)
        ended = (await http.get(f"/v1/responses/{waiting.json()['id']}", headers=key(ALPHA))).json()
        assert ended["status"] == "failed" and ended["error"]["code"] == "replica_stopped"
        assert await _status(http, running.json()["id"], "completed")
    assert core.answers() == 0 and len(model.answers) == 1


# --- open calls ------------------------------------------------------------------------------------


def test_open_calls_are_bounded_per_key_and_per_replica_with_a_named_429():
    calls = OpenCalls(OpenCallsConfig(max_per_replica=3, max_per_key=2))
    calls.take("a")
    calls.take("a")
    with pytest.raises(APIError) as per_key:
        calls.take("a")
    calls.take("b")
    with pytest.raises(APIError) as per_replica:
        calls.take("c")
    assert {per_key.value.code, per_replica.value.code} == {"open_call_limit"}
    assert per_key.value.status == per_replica.value.status == 429
    calls.give_back("a")
    calls.take("c")
    assert calls.held == 3 and dict(calls.by_key) == {"a": 1, "b": 1, "c": 1}


async def test_a_follower_holds_an_open_calls_place_not_a_generation_place_until_it_ends():
    core, model, _ = core_with()
    assert core.slots is not None
    follower = Exchange(app_of(core), "/v1/responses", BACKGROUND | {"stream": True}, ALPHA)
    assert await follower.status() == 200
    await wait_until(lambda: model.answers, 5, "the answer began")
    assert core.open_calls.held == 1 and core.slots.held == 1  # (the follower's, and the answer's own)
    model.answers[0].release.set()
    body = await follower.body()
    assert b"response.completed" in body
    assert core.open_calls.held == 0 and core.slots.held == 0
