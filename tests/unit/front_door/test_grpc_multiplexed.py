"""MultiplexedCall, the bookkeeping of a Stream call (many requests on one gRPC call), over a
runner that answers each request with a few responses it is told to release: pure logic, no
engine. The same call on the real app: tests/e2e/test_grpc_stream.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
from google.protobuf.message import Message

from serve_app.config import GRPCStreamConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.echoed import MAX_ID_CHARS
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.messages import error_message, wrap
from serve_app.front_door.grpc_api.multiplexed import MultiplexedCall


class Runner:
    """Each request answers ``max_tokens`` responses, the last final; one named "hold" waits for
    ``release`` before its last. Records what ran, what was cancelled and what was refused."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.refused: list[tuple[str, int]] = []

    async def run(
        self, kind: str, request: Message, stream_id: str, store: bool
    ) -> AsyncGenerator[pb.StreamResponse, None]:
        self.started.append(stream_id)
        tokens = request.max_tokens
        try:
            for index in range(tokens):
                if stream_id.startswith("hold") and index == tokens - 1:
                    await self.release.wait()
                final = index == tokens - 1
                yield wrap(stream_id, kind, index, pb.ChatCompletionResponse(completion_tokens=index + 1, final=final))
                await asyncio.sleep(0)  # (others interleave)
        except (asyncio.CancelledError, GeneratorExit):  # (closed mid-answer: the real runner aborts it)
            self.cancelled.append(stream_id)
            raise

    def refuse(self, kind: str, request: Message, stream_id: str, error: APIError) -> pb.StreamResponse:
        self.refused.append((stream_id, error.status))
        return self.final(kind, request, stream_id, 0, error)

    def final(self, kind: str, request: Message, stream_id: str, index: int, error: APIError) -> pb.StreamResponse:
        return wrap(stream_id, kind, index, pb.ChatCompletionResponse(final=True, error=error_message(error)))

    async def cancel(self, stream_id: str) -> bool:
        return False


def chat(stream_id: str, tokens: int = 3) -> pb.StreamRequest:
    return pb.StreamRequest(id=stream_id, chat=pb.ChatCompletionRequest(model="m", max_tokens=tokens))


def cancel(stream_id: str) -> pb.StreamRequest:
    return pb.StreamRequest(id=stream_id, cancel=pb.Cancel())


class Client:
    """The client's side: messages sent when the test says, then a half-close."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.StreamRequest | None] = asyncio.Queue()

    def send(self, *messages: pb.StreamRequest) -> None:
        for message in messages:
            self.queue.put_nowait(message)

    def half_close(self) -> None:
        self.queue.put_nowait(None)

    async def messages(self) -> AsyncIterator[pb.StreamRequest]:
        while (message := await self.queue.get()) is not None:
            yield message


def finals(responses: list[pb.StreamResponse]) -> dict[str, list[pb.ChatCompletionResponse]]:
    ended: dict[str, list[pb.ChatCompletionResponse]] = {}
    for response in responses:
        if response.WhichOneof("response") == "chat" and response.chat.final:
            ended.setdefault(response.id, []).append(response.chat)
    return ended


async def read_all(call: MultiplexedCall, client: Client) -> list[pb.StreamResponse]:
    return [response async for response in call.responses(client.messages())]


async def test_requests_interleave_and_each_ends_with_one_final_after_which_the_half_closed_call_ends():
    runner, client = Runner(), Client()
    client.send(*(chat(f"r{n}", tokens=4) for n in range(8)))
    client.half_close()
    responses = await asyncio.wait_for(read_all(MultiplexedCall(runner, GRPCStreamConfig()), client), 5)
    ended = finals(responses)
    assert sorted(ended) == [f"r{n}" for n in range(8)] and all(len(f) == 1 for f in ended.values())
    for n in range(8):
        assert [r.index for r in responses if r.id == f"r{n}"] == [0, 1, 2, 3]
    ids = [r.id for r in responses]
    assert ids != sorted(ids, key=lambda i: int(i[1:]))  # interleaved, not one after another


async def test_a_message_without_an_id_or_a_request_a_running_id_and_an_unknown_cancel_are_rejected_alone():
    """And an id past its bound (it would be copied into every response): rejected under its first
    128 characters, not echoed whole."""
    runner, client = Runner(), Client()
    client.send(
        chat("hold"),
        pb.StreamRequest(chat=pb.ChatCompletionRequest(model="m")),
        pb.StreamRequest(id="empty"),
        chat("hold"),
        cancel("nobody"),
        chat("x" * 5_000),
    )
    call = MultiplexedCall(runner, GRPCStreamConfig())
    reading = asyncio.create_task(read_all(call, client))
    while not (runner.started and client.queue.empty()):  # (the reader took each message whole)
        await asyncio.sleep(0.01)
    runner.release.set()
    client.half_close()
    responses = await asyncio.wait_for(reading, 5)
    rejected = {(r.id, r.rejected.param, r.rejected.http_status) for r in responses if r.HasField("rejected")}
    assert rejected == {
        ("", "id", 400),
        ("empty", "request", 400),
        ("hold", "id", 409),
        ("nobody", "id", 404),
        ("x" * MAX_ID_CHARS, "id", 400),
    }
    assert runner.started == ["hold"] and len(finals(responses)["hold"]) == 1


async def test_a_request_past_the_calls_bound_is_refused_alone():
    runner, client = Runner(), Client()
    client.send(chat("hold-1"), chat("hold-2"), chat("third"))
    call = MultiplexedCall(runner, GRPCStreamConfig(max_requests_at_once=2))
    reading = asyncio.create_task(read_all(call, client))
    while len(runner.refused) < 1:
        await asyncio.sleep(0.01)
    runner.release.set()
    while call._running:
        await asyncio.sleep(0.01)
    client.send(chat("fourth"))  # (a place is free again once one ended)
    client.half_close()
    responses = await asyncio.wait_for(reading, 5)
    assert runner.refused == [("third", 429)]
    ended = finals(responses)
    assert ended["third"][0].error.status == 8  # RESOURCE_EXHAUSTED
    assert not any(ended[i][0].HasField("error") for i in ("hold-1", "hold-2", "fourth"))


async def test_a_cancelled_request_ends_cancelled_while_the_others_finish():
    runner, client = Runner(), Client()
    client.send(chat("hold-a"), chat("hold-b"))
    call = MultiplexedCall(runner, GRPCStreamConfig())
    reading = asyncio.create_task(read_all(call, client))
    while len(runner.started) < 2:
        await asyncio.sleep(0.01)
    client.send(cancel("hold-a"))
    while not runner.cancelled:
        await asyncio.sleep(0.01)
    runner.release.set()
    client.half_close()
    responses = await asyncio.wait_for(reading, 5)
    ended = finals(responses)
    assert runner.cancelled == ["hold-a"]
    assert ended["hold-a"][0].error.status == 1 and ended["hold-a"][0].error.code == "cancelled"  # CANCELLED
    assert not ended["hold-b"][0].HasField("error") and len(ended["hold-b"]) == 1


async def test_closing_the_call_cancels_every_request_it_runs():
    runner, client = Runner(), Client()
    client.send(chat("hold-a", tokens=2), chat("hold-b", tokens=2))
    responses = MultiplexedCall(runner, GRPCStreamConfig()).responses(client.messages())
    assert (await anext(responses)).index == 0
    while len(runner.started) < 2:
        await asyncio.sleep(0.01)
    await responses.aclose()  # the client cancelled the call (or its connection dropped)
    assert sorted(runner.cancelled) == ["hold-a", "hold-b"]


async def test_a_client_that_does_not_read_holds_at_most_the_bound_of_responses():
    runner, client = Runner(), Client()
    client.send(*(chat(f"r{n}", tokens=5) for n in range(4)))
    client.half_close()
    call = MultiplexedCall(runner, GRPCStreamConfig(max_buffered_responses=3))
    responses = call.responses(client.messages())
    first = await anext(responses)  # (starts the call; one response taken)
    while call._buffer.qsize() < 3:
        await asyncio.sleep(0.01)
    for _ in range(100):  # every runner has had its turns: none wrote past the bound
        await asyncio.sleep(0)
    assert call._buffer.qsize() == 3
    rest = [response async for response in responses]
    assert len(rest) + 1 == 20 and first.index == 0


async def test_a_call_idle_past_its_idle_time_ends_and_one_running_a_request_does_not():
    """No request running and no message for ``idle_timeout_s``: the call ends, saying why; a request
    running longer than that keeps it open, and its end starts the idle time again."""
    runner, client = Runner(), Client()
    client.send(chat("hold-a", tokens=2))
    call = MultiplexedCall(runner, GRPCStreamConfig(idle_timeout_s=0.2))
    reading = asyncio.create_task(read_all(call, client))
    await asyncio.sleep(0.5)  # (longer than the idle time, with a request running: still open)
    assert not reading.done() and call.idled is None
    runner.release.set()
    responses = await asyncio.wait_for(reading, 5)  # (then idle: ended, the client never half-closed)
    assert finals(responses)["hold-a"][0].completion_tokens == 2
    assert call.idled is not None and "idle for 0.2 s" in call.idled


@pytest.mark.parametrize("bad", [0, -1])
def test_the_bounds_must_be_positive(bad):
    with pytest.raises(ValueError):
        GRPCStreamConfig(max_requests_at_once=bad)


async def test_a_request_reads_its_next_response_only_once_the_writer_took_the_last():
    """As a call of its own waits for each write: what the engine makes meanwhile is merged into
    its next output, not queued a response per token."""
    asked: list[int] = []  # how many responses the request had been asked for, as the writer took one

    class Counting(Runner):
        async def run(
            self, kind: str, request: Message, stream_id: str, store: bool
        ) -> AsyncGenerator[pb.StreamResponse, None]:
            async for response in super().run(kind, request, stream_id, store):
                asked.append(response.chat.completion_tokens)
                yield response

    runner, client = Counting(), Client()
    client.send(chat("r", tokens=6))
    client.half_close()
    taken = []
    async for response in MultiplexedCall(runner, GRPCStreamConfig()).responses(client.messages()):
        for _ in range(20):  # a slow writer: the request has every chance to read ahead
            await asyncio.sleep(0)
        taken.append(response.chat.completion_tokens)
        assert len(asked) == len(taken), (asked, taken)  # none read past the one written
    assert taken == [1, 2, 3, 4, 5, 6]
