"""Stored responses and background answers across replicas, on ``prefix``: two model replicas
over the suite's Redis (Debian's redis-server, as deploy/config.sim.yaml names it), with STORED's
short lease and expiry; and keys' ownership on ``glm-keyed`` (two API keys, the same Redis).

Each test on ``prefix`` calls the replicas' own HTTP servers (HAProxy's servers for the app), so
that it knows which replica answers: a background answer started on one is read, resumed and
cancelled through the other. With the official ``openai`` SDK, but where a stream ends with an
error event (which the SDK raises on), read as SSE text. The last test scales ``prefix`` in to one
replica (the module is its last user: tests/e2e/conftest.py's FIRST_MODULES).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import httpx
import openai
import pytest
import yaml
from ray.util.state import list_actors

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import FLOOD_KEY, LIGHT_KEY, STORED, application
from tests.e2e.harness.bodies import grpc_chat
from tests.e2e.harness.grpc_calls import Multiplexed
from tests.e2e.harness.grpc_calls import call as call_whole
from tests.e2e.harness.serve_state import (
    deployment_status,
    haproxy_server_addresses,
    haproxy_servers_up,
    only_one_running,
    serve_deploy_preserving,
)
from tests.e2e.harness.simulation import Bed, ready_bed
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("prefix", "glm-keyed")

KEY_A, KEY_B = FLOOD_KEY, LIGHT_KEY  # (glm-keyed's; prefix takes any)
EXACTLY = {"ignore_eos": True}  # (the simulated engine's answers run to max_output_tokens either way)
TOKENS = 120
SLOW = 20.0  # times the timing model's step: a long answer is still being generated when the test acts


@pytest.fixture
async def stored(variants) -> Bed:
    return await ready_bed(variants["prefix"], replicas=2)


async def replica_addresses(bed: Bed, stats_url: str, protocol: str = "http") -> list[str]:
    """Each replica's own HTTP (or gRPC) server's host:port, where HAProxy forwards, both replicas up."""

    async def both() -> list[str] | None:
        up = [server["svname"] for server in await haproxy_servers_up(stats_url, bed.model)]
        addresses = await asyncio.to_thread(haproxy_server_addresses, bed.app.name, protocol)
        return [addresses[name] for name in up if name in addresses] if len(up) == 2 else None

    addresses = await wait_until(both, 60, "HAProxy holding both replicas of prefix")
    assert len(addresses) == 2, addresses
    return addresses


async def replica_urls(bed: Bed, stats_url: str) -> list[str]:
    """Each replica's own base URL (its HTTP server), both replicas up."""
    return [f"http://{address}{bed.app.route_prefix}/v1" for address in await replica_addresses(bed, stats_url)]


def sdk(url: str, key: str = KEY_A) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


async def sse_events(url: str, path: str, key: str = KEY_A) -> list[tuple[str, dict]]:
    """A stream's events as (type, data), read whole."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.get(path, headers=headers)
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.split("\n\n"):
        if block:
            kind, data = block.split("\n", 1)
            events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def background(client: openai.AsyncOpenAI, model: str, tokens: int = TOKENS, **extra) -> str:
    response = await client.responses.create(
        model=model, input="Tell a long story.", background=True, max_output_tokens=tokens, extra_body=EXACTLY, **extra
    )
    assert (response.status, response.background) == ("queued", True)
    return response.id


async def test_a_dropped_background_stream_resumes_through_the_other_replica(stored, ray_cluster):
    """A background answer streamed from one replica, its connection dropped after 8 events, then
    resumed after the last event seen through the other replica: nothing lost, nothing repeated;
    the text is the stored response's, every sequence number once."""
    one, other = (sdk(url) for url in await replica_urls(stored, ray_cluster.haproxy_stats_url))
    await stored.engines.control_all(Control.PACE, 5.0)  # (the resumed reader follows the live tail)
    stream = await one.responses.create(
        model=stored.app.model,
        input="Tell a long story.",
        background=True,
        stream=True,
        max_output_tokens=TOKENS,
        extra_body=EXACTLY,
    )
    seen = []
    async for event in stream:
        seen.append(event)
        if len(seen) == 8:
            break
    await stream.close()  # the connection drops
    response_id = seen[0].response.id
    resumed = await other.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number)
    seen += [event async for event in resumed]
    final = await other.responses.retrieve(response_id)
    assert [event.sequence_number for event in seen] == list(range(len(seen)))
    assert seen[-1].type == "response.incomplete" and final.status == "incomplete"
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == final.output_text
    assert final.usage.output_tokens == TOKENS and final.background


async def test_a_kept_grpc_answer_resumes_through_the_other_replica(stored, ray_cluster):
    """A request kept (``keep``) on a Stream call to one replica's gRPC server, the call cancelled
    after 8 responses (its connection drops; the answer goes on); ``Resume`` through the other
    replica after the last index received returns the exact remainder: every index once, one
    final with the whole usage, the same responses as a Resume from the start. A missing id is
    NOT_FOUND, and the Responses API does not serve a kept answer."""
    one, other = await replica_addresses(stored, ray_cluster.haproxy_stats_url, "grpc")
    await stored.engines.control_all(Control.PACE, 5.0)  # (the resumed call follows the live tail)
    async with grpc.aio.insecure_channel(one) as grpc_channel:
        call = Multiplexed(pb_grpc.GenerationStub(grpc_channel))
        request = grpc_chat(stored.app.model, TOKENS, ignore_eos=True)
        await call.send(pb.StreamRequest(id="story", store=True, chat=request))
        await wait_until(lambda: len(call.responses) >= 8, 60, "8 responses of the kept request")
        call.call.cancel()
    seen = list(call.responses)
    answer_id = seen[0].answer_id
    async with grpc.aio.insecure_channel(other) as grpc_channel:
        stub = pb_grpc.GenerationStub(grpc_channel)
        rest = [r async for r in stub.Resume(pb.ResumeRequest(answer_id=answer_id, after_index=seen[-1].index))]
        whole = [r async for r in stub.Resume(pb.ResumeRequest(answer_id=answer_id, after_index=-1))]
    resumed = seen + rest
    assert [r.index for r in resumed] == list(range(len(resumed))) and resumed == whole
    assert {(r.id, r.answer_id) for r in resumed} == {("story", answer_id)}
    final = resumed[-1].chat
    assert final.final and not final.HasField("error") and final.usage.completion_tokens == TOKENS
    assert [r.chat.final for r in resumed].count(True) == 1
    async with grpc.aio.insecure_channel(other) as grpc_channel:
        stub = pb_grpc.GenerationStub(grpc_channel)
        missing = await call_whole(stub.Resume, pb.ResumeRequest(answer_id="ans_0123", after_index=-1))
        too_long = await call_whole(stub.Resume, pb.ResumeRequest(answer_id="ans_" + "0" * 5_000, after_index=-1))
    assert missing.code == grpc.StatusCode.NOT_FOUND and missing.responses == []
    assert too_long.code == grpc.StatusCode.INVALID_ARGUMENT and "answer_id" in too_long.details
    async with httpx.AsyncClient(base_url=(await replica_urls(stored, ray_cluster.haproxy_stats_url))[0]) as client:
        assert (await client.get(f"/responses/{answer_id}")).status_code == 404  # (not a Responses API response)


async def test_a_stored_answer_whose_call_dropped_is_cancelled_and_deleted_through_the_other_replica(
    stored, ray_cluster
):
    """A kept request's Stream call to one replica drops; ``CancelAnswer`` through the other replica
    stops its generation (the engine holds nothing more) and returns it ``cancelled``, its log ending
    with the cancel's final for ``Resume``; ``DeleteAnswer`` forgets it (then NOT_FOUND), and an id
    past its bound is INVALID_ARGUMENT."""
    one, other = await replica_addresses(stored, ray_cluster.haproxy_stats_url, "grpc")
    await stored.engines.control_all(Control.PACE, SLOW)
    async with grpc.aio.insecure_channel(one) as grpc_channel:
        call = Multiplexed(pb_grpc.GenerationStub(grpc_channel))
        await call.send(pb.StreamRequest(id="dropped", store=True, chat=grpc_chat(stored.app.model, 900)))
        await wait_until(lambda: len(call.responses) >= 2, 60, "the kept request under way")
        call.call.cancel()
    answer_id = call.responses[0].answer_id
    await stored.engines.wait_until_holding(1, within_s=30)  # (it runs on: its call is gone, not it)
    async with grpc.aio.insecure_channel(other) as grpc_channel:
        stub = pb_grpc.GenerationStub(grpc_channel)
        cancelled = await stub.CancelAnswer(pb.AnswerRequest(answer_id=answer_id))
        await stored.engines.wait_until_holding(0, within_s=30)
        rest = [r async for r in stub.Resume(pb.ResumeRequest(answer_id=answer_id, after_index=-1))]
        deleted = await stub.DeleteAnswer(pb.AnswerRequest(answer_id=answer_id))
        gone = await call_whole(stub.Resume, pb.ResumeRequest(answer_id=answer_id, after_index=-1))
        with pytest.raises(grpc.aio.AioRpcError) as too_long:
            await stub.CancelAnswer(pb.AnswerRequest(answer_id="ans_" + "0" * 5_000))
    assert (cancelled.answer_id, cancelled.status) == (answer_id, "cancelled")
    assert rest[-1].chat.final and rest[-1].chat.error.code == "response_cancelled"
    assert (deleted.status, deleted.deleted) == ("cancelled", True)
    assert gone.code == grpc.StatusCode.NOT_FOUND
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_two_readers_through_two_replicas_read_the_same_answer(stored, ray_cluster):
    urls = await replica_urls(stored, ray_cluster.haproxy_stats_url)
    response_id = await background(sdk(urls[0]), stored.app.model)
    path = f"/responses/{response_id}?stream=true"
    first, second = await asyncio.gather(*(sse_events(url, path) for url in urls))
    assert first == second
    assert [data["sequence_number"] for _, data in first] == list(range(len(first)))
    assert first[-1][0] == "response.incomplete"


async def test_a_cancel_through_the_other_replica_stops_the_generation(stored, ray_cluster):
    """Cancelled through the replica that does not generate it: the answer is ``cancelled`` once the
    call returns, the engine holds nothing more, and its log ends with the cancel's error event."""
    one, other = (sdk(url) for url in await replica_urls(stored, ray_cluster.haproxy_stats_url))
    await stored.engines.control_all(Control.PACE, SLOW)
    response_id = await background(one, stored.app.model, tokens=900)
    await stored.engines.wait_until_holding(1, within_s=30)
    asked = time.monotonic()
    cancelled = await other.responses.cancel(response_id)
    answered = time.monotonic() - asked
    assert cancelled.status == "cancelled"
    await stored.engines.wait_until_holding(0, within_s=30)
    print(f"the cancel returned in {answered * 1000:.0f} ms; the engine let the answer go by then or after")
    events = await sse_events(str(other.base_url), f"/responses/{response_id}?stream=true")
    assert events[-1][0] == "error" and events[-1][1]["code"] == "response_cancelled"
    assert (await other.responses.cancel(response_id)).status == "cancelled"  # again: as it is


async def test_another_keys_response_is_not_found(variants):
    """On ``glm-keyed``: a response stored under one key is a 404 to the other for every call on it,
    as a missing id is; its owner retrieves and deletes it."""
    keyed = (await ready_bed(variants["glm-keyed"])).app
    url = f"{keyed.url}/v1"
    mine = await sdk(url).responses.create(model=keyed.model, input="Hi!", max_output_tokens=4)
    assert (await sdk(url).responses.retrieve(mine.id)).output_text == mine.output_text
    theirs = sdk(url, KEY_B)
    for call in (theirs.responses.retrieve, theirs.responses.cancel, theirs.responses.delete):
        with pytest.raises(openai.NotFoundError):
            await call(mine.id)
    with pytest.raises(openai.NotFoundError) as continued:
        await theirs.responses.create(model=keyed.model, input="And?", previous_response_id=mine.id)
    assert continued.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await sdk(url).responses.retrieve("resp_0123456789abcdef")
    with pytest.raises(openai.BadRequestError) as too_long:  # (never sent to the store, nor quoted back)
        await sdk(url).responses.retrieve("resp_" + "0" * 5_000)
    assert too_long.value.body["param"] == "response_id" and len(too_long.value.message) < 300
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}) as client:
        bad = await client.get(f"/responses/{mine.id}", params={"stream": "true", "starting_after": "last"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"  # (not a background response)
    await sdk(url).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        await sdk(url).responses.retrieve(mine.id)


async def test_a_stored_response_expires(stored, ray_cluster):
    """``prefix`` keeps responses ``ttl_s`` (STORED) after their last change: then a GET is a 404."""
    client = sdk((await replica_urls(stored, ray_cluster.haproxy_stats_url))[0])
    started = time.monotonic()  # (before it is stored: it cannot expire sooner than ttl_s after this)
    made = await client.responses.create(model=stored.app.model, input="Hi!", max_output_tokens=4)

    async def gone() -> bool:
        try:
            await client.responses.retrieve(made.id)
        except openai.NotFoundError:
            return True
        return False

    await wait_until(gone, STORED["ttl_s"] + 60, f"{made.id} expired", every_s=0.5)
    print(f"expired {time.monotonic() - started:.1f} s after it was stored (ttl_s {STORED['ttl_s']:g})")
    assert time.monotonic() - started >= STORED["ttl_s"]


async def test_a_replica_killed_under_a_background_answer_gives_its_readers_the_failure_event(stored, ray_cluster):
    """The replica generating a background answer is killed (SIGKILL); a reader following it through
    the other replica gets, once the producer's lease lapsed (``lease_s``, STORED), the error event
    ``replica_lost``, and the stored response is ``failed``."""
    urls = await replica_urls(stored, ray_cluster.haproxy_stats_url)
    await stored.engines.control_all(Control.PACE, SLOW)
    response_id = await background(sdk(urls[0]), stored.app.model, tokens=900)
    states = await stored.engines.wait_until_holding(1, within_s=30)
    (producer,) = [replica for replica, state in states.items() if state.holds]
    reading = asyncio.create_task(sse_events(urls[1], f"/responses/{response_id}?stream=true"))
    (actor,) = await asyncio.to_thread(list_actors, filters=[("actor_id", "=", producer)])
    os.kill(actor.pid, signal.SIGKILL)
    events = await asyncio.wait_for(reading, 120)
    kind, last = events[-1]
    assert kind == "error" and last["code"] == "replica_lost"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert (await sdk(urls[1]).responses.retrieve(response_id)).status == "failed"


async def test_a_replica_stopped_by_scale_in_finishes_its_background_answers(stored, ray_cluster, cluster, tmp_path):
    """A background answer on each replica, held by the paused engines; the deployment scaled in to one
    replica. Serve drains the stopping replica's requests (a background answer is none of them),
    then its shutdown waits for its answer: once the engines resume, both answers end whole.
    (Last in the module: ``prefix`` stays at one replica.)"""
    urls = await replica_urls(stored, ray_cluster.haproxy_stats_url)
    config = yaml.safe_load(stored.app.config_path.read_text())
    (model,) = application(config, stored.app.name)["args"]["models"]
    model["deployment"]["num_replicas"] = 1
    scaled_in = tmp_path / "one-replica.yaml"
    scaled_in.write_text(yaml.safe_dump(config, sort_keys=False))
    async with stored.engines.paused():
        ids = [await background(sdk(url), stored.app.model) for url in urls]
        await stored.engines.wait_until_holding(2, within_s=30)
        await serve_deploy_preserving(scaled_in, stored.app.config_path, cluster)

        async def one_stopping() -> bool:
            status = await deployment_status(stored.model)
            return status is not None and status.replica_states.get("STOPPING", 0) == 1

        await wait_until(one_stopping, 60, "one replica of prefix stopping")

    async def reloaded() -> bool:  # (the suite drains a replica 1 s: HAProxy may still send it requests)
        return len(await haproxy_servers_up(ray_cluster.haproxy_stats_url, stored.model)) == 1

    await wait_until(reloaded, 60, "HAProxy holding only the replica that stays")
    client = sdk(f"{stored.app.url}/v1")  # (a connection of the HAProxy that no longer sends to the stopping one)

    async def ended() -> list | None:
        found = [await client.responses.retrieve(response_id) for response_id in ids]
        return found if all(f.status != "in_progress" and f.status != "queued" for f in found) else None

    for response in await wait_until(ended, 60, "both background answers ended"):
        assert response.status == "incomplete" and response.usage.output_tokens == TOKENS, (
            response.status,
            response.error,
        )
    await wait_until(lambda: only_one_running(stored.model), 60, "the stopping replica gone once its answer ended")
