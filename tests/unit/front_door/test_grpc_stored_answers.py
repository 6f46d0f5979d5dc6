"""Kept answers of the gRPC API (serve_app/front_door/grpc_api/stored_answers.py) in the in-process
store: each response logged under its index and read back after any index; a cancel ends the log
with a CANCELLED final. (Both stores meet the same log contract: test_stored_responses.py. A kept
answer resumed through another replica: tests/e2e/test_stored_responses.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc

from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.store import NO_OWNER
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.stored_answers import follow_answer, new_answer, produce


async def kept(store: MemoryStore) -> dict:
    answer = new_answer("chat", "s1")
    await store.save(answer["id"], NO_OWNER, answer, [], background=True)
    return answer


async def test_a_kept_answer_is_logged_response_by_response_and_read_back_after_any_index():
    store = MemoryStore(60, 10)
    answer = await kept(store)

    async def responses() -> AsyncGenerator[pb.ChatCompletionResponse, None]:
        for n in range(3):
            yield pb.ChatCompletionResponse(completion_tokens=n + 1, final=n == 2)

    await produce(store, answer, responses())
    read = [r async for r in follow_answer(store, answer, 0, 0.05)]
    assert [(r.id, r.index, r.answer_id, r.chat.completion_tokens) for r in read] == [
        ("s1", 1, answer["id"], 2),
        ("s1", 2, answer["id"], 3),
    ]
    assert read[-1].chat.final and (await store.load(answer["id"], NO_OWNER)).status == "completed"
    assert [r async for r in follow_answer(store, answer, 2, 0.05)] == []  # (after its final: nothing)


async def test_a_cancelled_kept_answer_ends_its_log_with_a_cancelled_final():
    store = MemoryStore(60, 10)
    answer = await kept(store)
    closed = asyncio.Event()

    async def responses() -> AsyncGenerator[pb.ChatCompletionResponse, None]:
        try:
            yield pb.ChatCompletionResponse(completion_tokens=1)
            await asyncio.Event().wait()  # generating, until cancelled
        finally:
            closed.set()  # (the engine's request is let go)

    producing = asyncio.create_task(produce(store, answer, responses()))
    while not await store.read(answer["id"], -1, 0):
        await asyncio.sleep(0.01)
    producing.cancel()
    await producing
    read = [r async for r in follow_answer(store, answer, -1, 0.05)]
    assert closed.is_set() and [r.index for r in read] == [0, 1]
    final = read[-1].chat
    cancelled = grpc.StatusCode.CANCELLED.value[0]
    assert final.final and (final.error.status, final.error.code) == (cancelled, "response_cancelled")
    assert (await store.load(answer["id"], NO_OWNER)).status == "cancelled"
