"""Fuzzed messages on one ``Stream`` call (issue 78): ids of any length and character, any mix of
chat, completion, cancel and empty requests, stored or not, fields of any value. Each request
ends with a rejection or one final, neither carrying a 5xx; the call ends with no INTERNAL or
UNKNOWN status, and promptly. Through the real service, admission and the in-process store, over
an engine that answers every request at once (tests/unit/front_door/fakes.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.front_door.admission.capacity import GenerationSlots
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.endpoints import default_endpoints
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.core.background import BackgroundAnswers
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.service import GenerationService
from serve_app.protocol import Outcome
from tests.unit.front_door.fakes import FakeContext, FakeModel, FixedReadiness

MODEL = "glm-4-9b-chat"
CALL_S = 10.0  # (every fuzzed call ends at once: its answers are canned)

# One canned answer both shapes read: a chat delta and a completion's text, then the outcome.
CHUNK = {"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"}, "text": "hi", "finish_reason": "stop"}]}
ANSWER = [f"data: {json.dumps(CHUNK | {'usage': {'prompt_tokens': 2, 'completion_tokens': 1}})}\n\n", Outcome(2, 1)]

TEXT = st.text(max_size=40)
NUMBERS = st.none() | st.integers(min_value=0, max_value=2**32 - 1)  # (the fields are uint32)
FLOATS = st.none() | st.floats(allow_nan=True, allow_infinity=True, width=32)
MESSAGES = st.lists(
    st.builds(pb.Message, role=st.sampled_from(["user", "system", "assistant", "tool", "wizard", ""]), content=TEXT),
    max_size=3,
)


def optional(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


CHAT = st.builds(
    lambda model, messages, max_tokens, temperature, n: pb.ChatCompletionRequest(
        model=model, messages=messages, **optional(max_tokens=max_tokens, temperature=temperature, n=n)
    ),
    st.sampled_from([MODEL]) | TEXT,
    MESSAGES,
    NUMBERS,
    FLOATS,
    st.none() | st.integers(min_value=0, max_value=300),
)
COMPLETION = st.builds(
    lambda model, prompt, max_tokens: pb.CompletionRequest(
        model=model, prompt=prompt, **optional(max_tokens=max_tokens)
    ),
    st.sampled_from([MODEL]) | TEXT,
    TEXT,
    NUMBERS,
)
IDS = st.text(max_size=300) | st.sampled_from(["a", "b", "c"])  # (few ids: duplicates and cancels find each other)
REQUESTS = st.one_of(
    st.builds(lambda i, chat, store: pb.StreamRequest(id=i, chat=chat, store=store), IDS, CHAT, st.booleans()),
    st.builds(lambda i, c, store: pb.StreamRequest(id=i, completion=c, store=store), IDS, COMPLETION, st.booleans()),
    st.builds(lambda i: pb.StreamRequest(id=i, cancel=pb.Cancel()), IDS),
    st.builds(lambda i: pb.StreamRequest(id=i), IDS),
)


def grpc_service() -> GenerationService:
    settings_ = IngressSettings(max_request_body_bytes=1 << 20, time_limits=TimeLimits(600, 120), log_requests=False)
    rules = BodyRules(settings_, ModelCatalog({MODEL: ModelEntry(MODEL, FakeModel([ANSWER]), 1024)}))
    store = MemoryStore(60, 100)
    stored = StoredResponses(store, store, BackgroundAnswers(store, 64, 60.0, 4), 60.0)
    core = FrontDoor(rules, slots=GenerationSlots(64, MODEL), stored=stored)
    return GenerationService(core, default_endpoints(), FixedReadiness(Readiness({MODEL: True}, 0.5, 30)))


async def sent(messages: list[pb.StreamRequest]) -> AsyncIterator[pb.StreamRequest]:
    for message in messages:
        yield message


@settings(max_examples=120, deadline=None)
@given(messages=st.lists(REQUESTS, min_size=1, max_size=6))
async def test_fuzzed_stream_messages_each_end_without_a_5xx_and_the_call_ends(messages):
    context = FakeContext()
    svc = grpc_service()

    async def read() -> list[pb.StreamResponse]:
        return [response async for response in svc.stream(sent(messages), context)]

    responses = await asyncio.wait_for(read(), CALL_S)
    assert context.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), context.details
    for response in responses:
        if response.HasField("rejected"):
            assert response.rejected.http_status < 500, response
        kind = response.WhichOneof("response")
        final = getattr(response, kind) if kind in ("chat", "completion") else None
        if final is not None and final.final and final.HasField("error"):
            assert final.error.http_status < 500, final.error
