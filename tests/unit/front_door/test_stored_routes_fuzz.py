"""Fuzzed calls on the stored responses' routes, on both real stores (the in-process one, Debian's
redis-server): ids, positions and flags of any shape get the answer or an OpenAI-shaped 4xx, never a
5xx, and every call ends (issue 78: ``starting_after`` past 2^64 gave a 200 then a cut stream, and
any Redis error a 500). Through the real HTTP app and admission, over a model held by the test."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import asyncio as aioredis

from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.redis_store import RedisStore
from serve_app.front_door.answer_log.store import ResponseStore
from tests.openai_errors import assert_openai_error
from tests.unit.front_door.cores import ALPHA, client, core_with, key
from tests.unit.front_door.stores import event, response

OWNER = "alpha"  # (the key id ALPHA's requests are owned by: tests/unit/front_door/fakes.py's KEYS)
KNOWN = "resp_" + "f" * 32  # a finished background answer of ALPHA's, kept again before each call
IDS = (
    st.text(max_size=300)
    | st.sampled_from([KNOWN, KNOWN + ":events", KNOWN + ":lease", "owner:alpha", "owner:alpha:bytes", "*", ".."])
    | st.text(alphabet="0123456789abcdef_resp:", max_size=200)
)
POSITIONS = (
    st.integers(min_value=-(2**70), max_value=2**70).map(str)
    | st.text(max_size=30)
    | st.sampled_from(["--1", "1e999", "-0", " 1", "0x10", "١", "18446744073709551616", "9" * 40])
)
FLAGS = st.sampled_from(["true", "false", "1", "TRUE", ""]) | st.text(max_size=5)
CALLS = st.sampled_from(["GET", "GET stream", "POST cancel", "DELETE"])


@pytest.fixture(params=["memory", "redis"])
async def store(request, redis_server) -> ResponseStore:
    if request.param == "memory":
        return MemoryStore(60, 100)
    return RedisStore(aioredis.Redis(port=redis_server.port, password=redis_server.password), 60, 100)


async def keep_known(store: ResponseStore) -> None:
    """A finished background answer (its log ended): every call on it ends at once."""
    await store.delete(KNOWN)
    await store.save(KNOWN, OWNER, response(KNOWN), [{"role": "user", "content": "hi"}], background=True)
    await store.append(KNOWN, 0, event("response.created", 0))
    completed = {"type": "response.completed", "sequence_number": 1, "response": response(KNOWN, "completed")}
    await store.append(KNOWN, 1, f"event: response.completed\ndata: {json.dumps(completed)}\n\n")
    await store.update(KNOWN, response(KNOWN, "completed"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=CALLS, response_id=IDS, starting_after=POSITIONS, stream=FLAGS)
async def test_fuzzed_calls_on_stored_responses_get_an_answer_or_a_4xx_and_end(
    store, call: str, response_id: str, starting_after: str, stream: str
):
    core, _, _ = core_with(store=store)
    await keep_known(store)
    path = f"/v1/responses/{quote(response_id, safe='')}"  # (any character, as a client may encode it)
    params = {"stream": "true" if call == "GET stream" else stream, "starting_after": starting_after}
    async with client(core) as http:
        if call.startswith("GET"):
            answer = await http.get(path, params=params, headers=key(ALPHA), timeout=10)
        elif call == "POST cancel":
            answer = await http.post(path + "/cancel", headers=key(ALPHA), timeout=10)
        else:
            answer = await http.delete(path, headers=key(ALPHA), timeout=10)
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        assert_openai_error(answer, answer.status_code)
