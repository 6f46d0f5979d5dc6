"""Many requests on one gRPC call (glm4serve.v1.Generation/Stream) on the bed, through Serve's
HAProxy to the model replica, with grpcio's asyncio client: each request is admitted, answered
and ended on its own, and the call ends once its client half-closed and every request ended.

A request past the replica's own bound: tests/e2e/test_direct_streaming.py (``direct``). A kept
answer resumed through the other replica: tests/e2e/test_stored_responses.py. The call's
bookkeeping without an engine: tests/unit/front_door/test_grpc_multiplexed.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.bodies import grpc_chat
from tests.e2e.harness.grpc_calls import Multiplexed, channel
from tests.waiting import wait_until

REQUESTS = 64  # on one call: the bed's replica takes 64 at once (deploy/config.sim.yaml)
SLOW = 20.0  # times the timing model's step: answers still run while the test acts


@pytest.fixture
async def stub(bed) -> AsyncIterator[pb_grpc.GenerationStub]:
    async with channel(bed.app) as grpc_channel:
        yield pb_grpc.GenerationStub(grpc_channel)


def request(stream_id: str, model: str, tokens: int, **fields) -> pb.StreamRequest:
    return pb.StreamRequest(id=stream_id, chat=grpc_chat(model, tokens, ignore_eos=True, **fields))


async def test_64_requests_on_one_call_each_deliver_their_tokens_and_one_final_interleaved(bed, stub):
    """64 requests of different lengths on one call each deliver exactly their ``max_tokens`` and
    one final response, their responses interleaved; an invalid request on the same call gets its
    own INVALID_ARGUMENT final, a second request under a running id is rejected, and the call ends
    OK once the client half-closed."""
    call = Multiplexed(stub)
    # The invalid request first, its final awaited: it holds one of the replica's 64 places from its
    # arrival until it is refused (sent after the 64, it found them all held on a busy machine: 429).
    await call.send(request("bad", bed.app.model, 4, temperature=5))
    await wait_until(lambda: call.of("bad"), 30, "the invalid request's final")
    lengths = {f"r{n}": 8 + n % 5 * 4 for n in range(REQUESTS)} | {"r0": 100}
    for stream_id, tokens in lengths.items():
        await call.send(request(stream_id, bed.app.model, tokens))
        if stream_id == "r0":  # (it runs for a while: 100 tokens)
            await call.send(request("r0", bed.app.model, 4))
    code, details = await call.close()
    assert code == grpc.StatusCode.OK, details
    for stream_id, tokens in lengths.items():
        responses = call.of(stream_id)
        finals = [r for r in responses if r.final]
        assert finals == [responses[-1]] and not finals[0].HasField("error"), finals
        assert finals[0].usage.completion_tokens == tokens
        assert "".join(c.content for r in responses for c in r.choices) != ""
    (bad,) = call.of("bad")
    assert (bad.final, bad.error.status, bad.error.param) == (
        True,
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        "temperature",
    )
    duplicate = [r for r in call.responses if r.id == "r0" and r.HasField("rejected")]
    assert [(r.rejected.code, r.rejected.param) for r in duplicate] == [("duplicate_id", "id")]
    order = [r.id for r in call.responses if not r.HasField("rejected")]
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches > REQUESTS, f"responses of different requests interleave ({switches} switches)"
    indexes = [r.index for r in call.responses if r.id == "r1"]
    assert indexes == list(range(len(indexes)))


async def test_cancelling_one_request_frees_its_engine_slot_while_the_others_go_on(bed, stub):
    """A cancel of one id: the engine lets that request go within a second, its final response is
    CANCELLED, and the call's other requests still run and end whole."""
    await bed.engines.control_all(Control.PACE, SLOW)
    call = Multiplexed(stub)
    for stream_id in ("a", "b", "c"):
        await call.send(request(stream_id, bed.app.model, 40))
    await bed.engines.wait_until_holding(3, within_s=30)
    asked = time.monotonic()
    await call.send(pb.StreamRequest(id="b", cancel=pb.Cancel()))
    await bed.engines.wait_until_holding(2, within_s=30)
    freed_s = time.monotonic() - asked
    cancelled = await call.ended("b")
    assert (cancelled.error.status, cancelled.error.code) == (grpc.StatusCode.CANCELLED.value[0], "cancelled")
    await bed.engines.control_all(Control.PACE, 1.0)
    code, _ = await call.close()
    assert code == grpc.StatusCode.OK
    for stream_id in ("a", "c"):
        final = call.of(stream_id)[-1]
        assert final.final and not final.HasField("error") and final.usage.completion_tokens == 40
    print(f"the engine let the cancelled request go {freed_s * 1000:.0f} ms after the cancel was sent")


async def test_a_kept_request_cancelled_on_its_call_ends_cancelled_and_so_does_its_log(bed, stub):
    """A kept request (``keep``) is generated apart from its call: a cancel on the call stops it in
    the engine, its final on the call is CANCELLED, and ``Resume`` reads the same end from its log."""
    await bed.engines.control_all(Control.PACE, SLOW)
    call = Multiplexed(stub)
    await call.send(pb.StreamRequest(id="kept", store=True, chat=grpc_chat(bed.app.model, 40, ignore_eos=True)))
    await bed.engines.wait_until_holding(1, within_s=30)
    await call.send(pb.StreamRequest(id="kept", cancel=pb.Cancel()))
    await bed.engines.wait_until_holding(0, within_s=30)
    final = await call.ended("kept")
    code, _ = await call.close()
    assert code == grpc.StatusCode.OK
    assert (final.error.status, final.error.code) == (grpc.StatusCode.CANCELLED.value[0], "response_cancelled")
    answer_id = call.responses[-1].answer_id
    resumed = [r async for r in stub.Resume(pb.ResumeRequest(answer_id=answer_id, after_index=-1))]
    assert resumed[-1].chat == final and [r.index for r in resumed] == list(range(len(resumed)))


async def test_ending_the_call_aborts_every_request_on_it(bed, stub):
    await bed.engines.control_all(Control.PACE, SLOW)
    call = Multiplexed(stub)
    for stream_id in ("a", "b", "c"):
        await call.send(request(stream_id, bed.app.model, 40))
    await bed.engines.wait_until_holding(3, within_s=30)
    call.call.cancel()
    await bed.engines.wait_until_holding(0, within_s=30)
