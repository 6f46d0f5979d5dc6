"""A model replica's own front door (direct streaming): its queue bound, and its calls to itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from serve_app.errors import APIError
from serve_app.front_door.admission.auth import APIKeyMiddleware, APIKeys
from serve_app.front_door.admission.capacity import FairShare, GenerationSlots
from serve_app.front_door.admission.deadlines import DeadlineExceeded, TimeLimits, next_before
from serve_app.front_door.admission.models import ModelCatalog
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.local_engine import LocalModel, PrefixRoute, RoutedAnswer
from serve_app.front_door.http_api.middleware import Arrivals, ObserveRequests
from serve_app.front_door.telemetry.record import RequestRecord
from serve_app.protocol import WholeAnswer
from tests.waiting import wait_until


def arrivals(slots: GenerationSlots, paths: frozenset[str] = frozenset({"/v1/chat/completions"})) -> Middleware:
    """The HTTP door's permits from arrival, over a core with ``slots`` (and nothing else)."""
    settings = IngressSettings(max_request_body_bytes=1 << 20, time_limits=TimeLimits(600, 120))
    return Middleware(Arrivals, core=FrontDoor(BodyRules(settings, ModelCatalog({})), slots=slots), paths=paths)


def held_app(release: asyncio.Event, entered: list[str], limit: int) -> Starlette:
    async def generate(request: Request) -> Response:
        entered.append("generation")
        await release.wait()
        return JSONResponse({"ok": True})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [Route("/v1/chat/completions", generate, methods=["POST"]), Route("/health", health)]
    capacity = arrivals(GenerationSlots(limit))
    return Starlette(routes=routes, middleware=[capacity])


async def test_past_its_limit_a_generation_request_gets_the_overloaded_429_and_others_pass() -> None:
    import httpx

    release, entered = asyncio.Event(), list[str]()
    app = held_app(release, entered, limit=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
        held = [asyncio.create_task(client.post("/v1/chat/completions", json={})) for _ in range(2)]
        await wait_until(lambda: len(entered) >= 2, 10, "2 requests entered", every_s=0)
        refused = await client.post("/v1/chat/completions", json={})
        health = await client.get("/health")
        release.set()
        answers = await asyncio.gather(*held)
        after = await client.post("/v1/chat/completions", json={})  # the places are free again
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"] == {
        "message": "the model is overloaded; retry shortly",
        "type": "rate_limit_error",
        "param": None,
        "code": "overloaded",
    }
    assert health.status_code == 200
    assert [a.status_code for a in answers] == [200, 200] and after.status_code == 200


def test_a_refused_request_is_counted_against_the_replicas_model() -> None:
    """Its body is never read, but the replica serves one model: the refusal's metrics carry it."""
    records: list[RequestRecord] = []
    routes = [Route("/v1/chat/completions", lambda request: JSONResponse({}), methods=["POST"])]
    middleware = [
        Middleware(ObserveRequests, paths={"/v1/chat/completions": "chat"}, observers=[records.append]),
        arrivals(GenerationSlots(0, "glm-4-9b-chat")),
    ]
    client = TestClient(Starlette(routes=routes, middleware=middleware))
    assert client.post("/v1/chat/completions", json={}).status_code == 429
    assert [(r.status, r.model, r.error_code) for r in records] == [(429, "glm-4-9b-chat", "overloaded")]


def test_a_get_or_another_path_never_takes_a_place() -> None:
    release, entered = asyncio.Event(), list[str]()
    release.set()
    client = TestClient(held_app(release, entered, limit=0))
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json={}).status_code == 429


REQUEST = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_a_local_call_streams_the_replicas_answer_and_cancelling_it_closes_the_generation() -> None:
    closed = asyncio.Event()
    seen: list[tuple[object, object]] = []

    async def chat(payload: object, trace_context: dict[str, str] | None) -> AsyncGenerator[str, None]:
        seen.append((payload, trace_context))
        try:
            for chunk in ("data: 1\n\n", "data: 2\n\n", "data: 3\n\n"):
                yield chunk
        finally:
            closed.set()

    async def completion(payload: object, trace_context: dict[str, str] | None) -> AsyncGenerator[str, None]:
        yield "unused"

    model = LocalModel({"chat": chat, "completion": completion})
    answer = model.generate("chat", REQUEST, {"traceparent": "t"})
    assert await anext(answer) == "data: 1\n\n"
    answer.cancel()
    await asyncio.wait_for(closed.wait(), 5)
    assert seen == [(REQUEST, {"traceparent": "t"})]
    answer.cancel()  # twice is harmless


async def test_a_deadline_that_passes_during_a_local_unary_call_fires_though_the_generation_swallows_it() -> None:
    """vLLM's unary path catches the cancellation and returns its 400 "Client disconnected";
    called in-process, that reply must not stand in for the deadline's 504."""
    swallowed = asyncio.Event()

    async def chat(payload: object, trace_context: dict[str, str] | None) -> AsyncGenerator[str, None]:
        try:
            await asyncio.Event().wait()  # a paused engine
        except asyncio.CancelledError:
            swallowed.set()
            yield "400 Client disconnected"  # as vLLM's full generator answers a cancellation
            return
        yield "never"

    async def completion(payload: object, trace_context: dict[str, str] | None) -> AsyncGenerator[str, None]:
        yield "unused"

    answer = LocalModel({"chat": chat, "completion": completion}).generate("chat", REQUEST, None)
    with pytest.raises(DeadlineExceeded):
        await next_before(answer, asyncio.get_running_loop().time() + 0.05)
    assert swallowed.is_set()


async def test_once_the_engine_failed_a_request_goes_to_the_other_replicas_and_never_before() -> None:
    """HAProxy hands a connection to a replica whose engine has just died: the request is
    not refused there, it goes to the deployment's other replicas through the handle."""
    failed = False
    sent_elsewhere: list[tuple[str, object, object]] = []

    class Elsewhere:
        def __init__(self, method: str) -> None:
            self.method = method

        def remote(self, payload: object, trace_context: dict[str, str] | None = None) -> str:
            sent_elsewhere.append((self.method, payload, trace_context))
            return f"{self.method} from another replica"

    class Others:
        chat = Elsewhere("chat")
        completion = Elsewhere("completion")

    async def here(payload: object, trace_context: dict[str, str] | None) -> AsyncGenerator[str, None]:
        yield "answered here"

    model = LocalModel({"chat": here, "completion": here}, engine_failed=lambda: failed, others=cast(Any, Others()))
    assert await anext(model.generate("chat", REQUEST, None)) == "answered here"
    assert sent_elsewhere == []
    failed = True
    assert model.generate("chat", REQUEST, {"traceparent": "t"}) == "chat from another replica"
    assert model.generate("completion", REQUEST, None) == "completion from another replica"
    assert sent_elsewhere == [("chat", REQUEST, {"traceparent": "t"}), ("completion", REQUEST, None)]


async def test_each_generation_request_carries_its_keys_rank_and_a_key_holding_its_share_gets_429() -> None:
    """Behind the key middleware, as the replica's app has it: the rank reaches the route (which sets
    the request's engine priority from it), and a key holding its part of the kept places is refused."""
    import httpx

    keys = ("a" * 24, "b" * 24)
    release, ranks = asyncio.Event(), list[int]()

    async def generate(request: Request) -> Response:
        ranks.append(request.state.permit.rank)
        await release.wait()
        return JSONResponse({"ok": True})

    slots = GenerationSlots(limit=4, fair_share=FairShare(limit=4, reserved=2))
    middleware = [
        Middleware(APIKeyMiddleware, keys=APIKeys("test keys", lambda: "\n".join(keys))),
        arrivals(slots),
    ]
    app = Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"])], middleware=middleware)

    def post(client: httpx.AsyncClient, key: str) -> Any:
        return client.post("/v1/chat/completions", json={}, headers={"Authorization": f"Bearer {key}"})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
        held = [asyncio.create_task(post(client, keys[0])) for _ in range(2)]
        await wait_until(lambda: len(ranks) >= 2, 10, "2 requests entered", every_s=0)
        refused = await post(client, keys[0])  # 2 free, both kept: a lone key holds 2 of them already
        held.append(asyncio.create_task(post(client, keys[1])))
        await wait_until(lambda: len(ranks) >= 3, 10, "3 requests entered", every_s=0)
        release.set()
        answers = await asyncio.gather(*held)
    assert ranks == [0, 1, 0]
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "fair_share_exceeded"
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert slots.held == 0 and slots.by_key == {}


@pytest.mark.parametrize(
    ("path", "body", "sequences"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, 4),
        ("/v1/completions", {"prompt": "a"}, 1),
    ],
    ids=["chat n 3", "2 prompts n 2", "one"],
)
def test_a_request_holds_a_place_for_each_engine_sequence_it_starts_until_it_ends(path, body, sequences) -> None:
    """Through the replica's real HTTP app: one place from arrival, as many as its sequences once
    its body is read, all given back at the end; a request whose sequences are not free is the 429
    overloaded and reaches no engine."""
    from tests.unit.front_door.fakes import client_for

    slots = GenerationSlots(limit=sequences, model="glm-4-9b-chat")
    client, handle = client_for([WholeAnswer(200, b"{}")], slots=slots)
    held_at_call: list[int] = []
    handle.on_call = lambda: held_at_call.append(slots.held)
    assert client.post(path, json={"model": "glm-4-9b-chat"} | body).status_code == 200
    assert held_at_call == [sequences] and slots.held == 0
    tighter = GenerationSlots(limit=sequences - 1, model="glm-4-9b-chat")
    if sequences > 1:
        client, handle = client_for([WholeAnswer(200, b"{}")], slots=tighter)
        refused = client.post(path, json={"model": "glm-4-9b-chat"} | body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        assert handle.payloads == [] and tighter.held == 0


def test_a_keys_sequences_count_toward_its_rank_and_its_share() -> None:
    slots = GenerationSlots(limit=10, fair_share=FairShare(limit=10, reserved=4))
    with slots.hold(key_id="a") as first:
        first.grow_to(3)
        assert (first.rank, slots.held, slots.by_key) == (0, 3, {"a": 3})
        with slots.hold(key_id="a") as second:
            assert second.rank == 3  # the places its key held before: three sequences
            second.grow_to(3)  # 6 held, 4 free, all kept: a lone key's part is 4, it holds 4 after 1
            with pytest.raises(APIError) as refused:
                second.grow_to(5)
            assert refused.value.code == "fair_share_exceeded" and second.places == 3
            with slots.hold(key_id="b") as other:
                other.grow_to(2)  # a key holding nothing takes its part of the kept places (4 // 2)
                assert slots.held == 8
    assert slots.held == 0 and slots.by_key == {}


async def test_under_a_bare_serve_run_a_replica_answers_itself_when_the_picker_cannot_be_asked() -> None:
    """The picker's replica died (its call raises): the request is answered here, where Serve's
    proxy sent it by load, not failed."""

    class GonePicker:
        class pick:
            @staticmethod
            async def remote(*args: Any) -> str:
                raise ConnectionError("the picker's replica died")

    async def here() -> AsyncGenerator[str, None]:
        yield "answered here"

    route = PrefixRoute(cast(Any, GonePicker()), "this replica")
    answer = RoutedAnswer(route, "chat", cast(Any, None), cast(Any, None), None, cast(Any, here))
    assert [chunk async for chunk in answer] == ["answered here"]
