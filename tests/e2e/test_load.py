"""The serving layer under load, on the bed (the simulated engine, driven through its controls):
streaming, stream batching, abandoned streams, time limits, and a burst past the queue.

Where a test needs the engine to hold requests while it acts, it pauses the engine: requests
are admitted and held, and no token comes until it resumes. Where it needs streams still
under way when it acts, it slows the engine's pace. Nothing here races the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time

import grpc
import httpx
import yaml

from benchmarks.client import carries_tokens
from serve_app.config import parse_app_config
from serve_app.front_door import metrics
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import application
from tests.e2e.harness.bodies import LONG, chat, grpc_chat
from tests.e2e.harness.grpc_calls import call, channel
from tests.e2e.harness.serve_state import ongoing_at
from tests.e2e.harness.streams import open_streams
from tests.e2e.harness.telemetry import increase, scrape, settled, total
from tests.waiting import wait_until

STREAMS = 16


async def test_each_streams_first_token_arrives_while_generation_still_runs(bed):
    """Streams are streamed, not delivered whole: no layer between engine and socket buffers them.

    Sixteen equal long streams, admitted while the engine is paused, start together and end
    together. The client numbers what it reads in order of arrival: every stream's first token
    must come before any stream's end.
    A layer that held chunks back until an answer ended would deliver each stream's first
    token with its end, after the first end.
    """
    app = bed.app
    arrivals = itertools.count()
    limits = httpx.Limits(max_connections=STREAMS)
    async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=limits) as client:

        async def one() -> tuple[int, int]:
            """When this stream's first token and its end arrived, as places in ``arrivals``."""
            first_token = -1
            async with client.stream("POST", "/v1/chat/completions", json=chat(app.model, LONG, stream=True)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if first_token < 0 and line.startswith("data: {") and carries_tokens(json.loads(line[6:])):
                        first_token = next(arrivals)
                    elif line == "data: [DONE]":
                        return first_token, next(arrivals)
            raise AssertionError("a stream ended without [DONE]")

        # All admitted before any runs (the engine paused meanwhile), so they start together
        # whatever the client's host: the order compared is the engine's, not the client's.
        async with bed.engines.paused():
            streams = [asyncio.create_task(one()) for _ in range(STREAMS)]
            await bed.engines.wait_until_holding(STREAMS)
        results = await asyncio.gather(*streams)
    first_end = min(end for _, end in results)
    assert all(0 <= first < first_end for first, _ in results), sorted(results)


async def test_chunks_carry_more_tokens_while_the_engine_is_busy(bed):
    """StreamBatchingConfig: alone, a stream gets a token per chunk; one that starts while the
    engine holds other requests gets several per chunk, every token in order; a client's own
    ``stream_interval`` wins. Tokens are counted by logprobs.

    The engine is paused while the held requests and then the two measured streams arrive, so
    what each stream started beside is known; it resumes once all are in."""
    app = bed.app
    batching = parse_app_config(application(yaml.safe_load(app.config_path.read_text()), app.name)["args"])
    batching = batching.models[0].stream_batching
    tokens = 48
    held = 4 * batching.requests_per_token

    async def chunk_sizes(client: httpx.AsyncClient, **extra) -> list[int]:
        body = chat(app.model, tokens, stream=True, logprobs=True, **extra)
        sizes = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
                    if logprobs := choices[0].get("logprobs"):
                        sizes.append(len(logprobs["content"]))
        assert sum(sizes) == tokens, sizes
        return sizes

    limits = httpx.Limits(max_connections=held + 2)
    async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=limits) as client:
        alone = await chunk_sizes(client)
        async with bed.engines.paused():
            holding = [
                asyncio.create_task(client.post("/v1/chat/completions", json=chat(app.model, 4 * tokens)))
                for _ in range(held)
            ]
            await bed.engines.wait_until_holding(held)
            measured = asyncio.gather(chunk_sizes(client), chunk_sizes(client, stream_interval=1))
            await bed.engines.wait_until_holding(held + 2)
        sizes, own = await measured
        answers = await asyncio.gather(*holding)
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers if a.status_code != 200]
    # Alone, token by token (vLLM merges tokens its consumer had not taken yet, rarely here).
    assert alone.count(1) >= 0.75 * len(alone), alone
    # vLLM sends the first token at once, then every k tokens, then the rest with the last.
    # Each measured stream started beside the held requests and perhaps the other stream.
    k = max(sizes)
    assert k in {batching.tokens_per_chunk(held), batching.tokens_per_chunk(held + 1)} and k >= 2, sizes
    assert sizes[0] == 1 and set(sizes[1:-1]) == {k} and sizes[-1] <= k, sizes
    # The client's own stream_interval=1 wins: token by token (now and then two merged), not k at a time.
    middle = own[1:-1]
    assert len(own) > len(sizes) and sum(size != k for size in middle) > 0.5 * len(middle), own
    print(f"alone: {len(alone)} chunks; beside {held} requests: {len(sizes)} chunks ({k} tokens each)")


def counted(metrics_url: str, name: str, **labels: str) -> float:
    return total(scrape(metrics_url), f"ray_{name}_total", **labels)


async def test_abandoned_streams_leave_the_engine_and_are_counted_as_aborted(bed, metrics_url):
    """Sixteen long streams whose clients leave once each has its first chunk: the engine lets
    every one go, and each is counted once as aborted. At a tenth of the engine's pace the
    streams cannot end by themselves meanwhile (900 tokens take a minute)."""
    app = bed.app
    labels = {"application": app.name, "model": app.model}
    samples_before = await settled(metrics_url, f"ray_{metrics.ABORTED}_total")
    await bed.engines.control_all(Control.PACE, 10.0)
    async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        async with open_streams(client, chat(app.model, LONG, stream=True), STREAMS):
            assert await bed.engines.holds() == STREAMS
        left = time.monotonic()
        await bed.engines.wait_until_holding(0, within_s=30)
    took = time.monotonic() - left

    def aborted() -> float:
        return increase(samples_before, scrape(metrics_url), f"ray_{metrics.ABORTED}_total", **labels)

    await wait_until(lambda: aborted() >= STREAMS, 60, f"{STREAMS} streams counted as aborted")
    assert aborted() == STREAMS
    print(f"{STREAMS} streams aborted; the engine held none {took:.3f} s after their clients left")


async def test_a_client_cannot_keep_its_answer_generating_after_it_left(bed):
    """Serve would keep a unary answer generating after its client left when the request says
    ``x-request-disconnect-disabled: ?1`` (holding a place and a key's lease for up to the answer's
    limit): the replica ignores that header, and the engine lets the request go as for any client
    that leaves. At a tenth of the engine's pace the answer (900 tokens) would take a minute."""
    app = bed.app
    await bed.engines.control_all(Control.PACE, 10.0)
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        headers = {"x-request-disconnect-disabled": "?1"}
        answer = asyncio.create_task(client.post("/v1/chat/completions", json=chat(app.model, LONG), headers=headers))
        await bed.engines.wait_until_holding(1, within_s=30)
        answer.cancel()  # the client leaves: httpx closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await answer
    await bed.engines.wait_until_holding(0, within_s=30)


async def test_stream_past_its_time_limit_ends_with_an_error_event_and_is_aborted(bed):
    """At a tenth of the pace, 900 tokens take a minute: the stream's 2 s limit ends it mid-answer."""
    app = bed.app
    await bed.engines.control_all(Control.PACE, 10.0)
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        body = chat(app.model, LONG, stream=True)
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Request-Timeout": "2"}
        ) as response:
            assert response.status_code == 200
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events and "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert (error["code"], error["type"]) == ("request_timeout", "timeout_error")
    assert any(carries_tokens(json.loads(e)) for e in events[:-1])  # it had started
    await bed.engines.wait_until_holding(0, within_s=30)


async def test_unary_answer_past_its_time_limit_is_504_and_aborted(bed):
    """Held by a paused engine, a unary request's 0.5 s limit passes: 504, and the engine lets it go."""
    app = bed.app
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client, bed.engines.paused():
        response = await client.post(
            "/v1/chat/completions", json=chat(app.model, LONG), headers={"X-Request-Timeout": "0.5"}
        )
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
        await bed.engines.wait_until_holding(0, within_s=30)  # still paused: it left, it did not end


async def test_stream_without_its_first_token_in_time_is_504_and_aborted(bed):
    """The first-token deadline: while the engine holds 8 streams and is paused, a stream whose
    first chunk cannot come within its limit gets 504 ``first_token_timeout`` and leaves the
    engine. (X-Request-Timeout caps ``first_token_timeout_s``.)"""
    app = bed.app
    held = 8
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        async with open_streams(client, chat(app.model, LONG, stream=True), held), bed.engines.paused():
            body = chat(app.model, LONG, stream=True)
            response = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": "0.5"})
            assert response.status_code == 504, response.text
            error = response.json()["error"]
            assert (error["code"], error["type"]) == ("first_token_timeout", "timeout_error")
            await bed.engines.wait_until_holding(held, within_s=30)  # only the held streams remain


QUEUE = 64 + 512  # what the bed's one model replica runs (max_ongoing_requests) and queues (max_queued_requests)
BURST = QUEUE + 224
BURST_TOKENS = 24
GRPC_CALLS = 16  # sent while the queue is full
HEALTH_PROBES = 20  # GET /health while the queue is full


async def test_burst_past_the_queue_gets_quick_429s_and_the_rest_complete(bed, metrics_url):
    """A burst past what one replica runs and queues, sent while its engine is paused: the replica
    fills, at most what it runs and queues is admitted and at least the excess is refused (429
    with the retry hint), each refusal before any answer ends; gRPC calls sent while the queue is
    full get RESOURCE_EXHAUSTED with the same hint and one final response; ``/health`` still
    answers; once the engine resumes, every admitted request completes, the app answers
    normally, and the refusals are all counted.

    The paused phase takes seconds; on a host so loaded that it outlasts the bed's request
    deadline, requests still queued then end as the product promises, with the deadline's 504,
    never sooner: such a 504 counts as admitted, and its time is checked against the deadline
    (the refusals must still all come before it). The phase's timings are printed first.

    (Exactly the excess is refused when Serve's router meets the burst fresh; within seconds of
    other traffic it may refuse some more while it dispatches, by its own account: see
    ``wrap_request_assignment`` in ray/serve/_private/router.py. The counts are printed.)"""
    app = bed.app
    config = application(yaml.safe_load(app.config_path.read_text()), app.name)
    deployment = config["args"]["models"][0]["deployment"]
    assert deployment["max_ongoing_requests"] + deployment["max_queued_requests"] == QUEUE
    deadline_s = config["args"]["ingress"]["request_timeout_s"]  # a unary request's only deadline
    # Full: the replica's front door admits what it runs and queues, and the engine queues past
    # its batch (serve_app.deployments.options.model_server_options).
    full = QUEUE

    def timed_out(status: int, seconds: float, response: httpx.Response) -> bool:
        """The deadline's 504, and not before the deadline (the client's clock starts first)."""
        if status != 504:
            return False
        assert response.json()["error"]["code"] == "request_timeout", response.text
        assert seconds >= deadline_s, (seconds, deadline_s)
        return True

    labels = {"application": app.name, "model": app.model, "reason": "overloaded"}
    rejected_before = counted(metrics_url, metrics.REJECTED, **labels)
    (replica,) = await bed.engines.replicas()
    limits = httpx.Limits(max_connections=BURST + HEALTH_PROBES, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=app.url, timeout=300, limits=limits) as client:

        async def one() -> tuple[int, float, httpx.Response]:
            start = time.monotonic()
            response = await client.post("/v1/chat/completions", json=chat(app.model, BURST_TOKENS))
            return response.status_code, time.monotonic() - start, response

        async with bed.engines.paused():
            paused_at = time.monotonic()
            burst = [asyncio.create_task(one()) for _ in range(BURST)]
            await bed.engines.wait_until_holding(full)  # the replica full
            full_s = time.monotonic() - paused_at
            assert await ongoing_at(replica) == full
            await wait_until(
                lambda: sum(task.done() for task in burst) >= BURST - QUEUE, 120, f"{BURST - QUEUE} refusals"
            )
            refused_s = time.monotonic() - paused_at
            async with channel(app) as grpc_channel:
                stub = pb_grpc.GenerationStub(grpc_channel)
                request = grpc_chat(app.model, 8)
                calls = await asyncio.gather(*(call(stub.ChatCompletion, request) for _ in range(GRPC_CALLS)))
            probes = []
            for _ in range(HEALTH_PROBES):
                started = time.monotonic()
                probes.append(((await client.get("/health")).status_code, time.monotonic() - started))
            paused_s = time.monotonic() - paused_at
            print(f"engine paused {paused_s:.1f} s: replica full at {full_s:.1f} s, excess refused at {refused_s:.1f}")
            ended = [task.result() for task in burst if task.done()]
            # Held meanwhile: no answer ended, only refusals (and deadlines, if the phase outlasted one).
            assert all(r[0] == 429 or timed_out(*r) for r in ended), {r[0] for r in ended}
        results = await asyncio.gather(*burst)
        after = await client.post("/v1/chat/completions", json=chat(app.model, 8))
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8  # normal right after

    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429, 504} and 429 in statuses, set(statuses)
    done = [t for s, t, r in results if s == 200 and r.json()["usage"]["completion_tokens"] == BURST_TOKENS]
    expired = [t for s, t, r in results if timed_out(s, t, r)]
    refused = [(t, r) for s, t, r in results if s == 429]
    assert len(done) == statuses.count(200)  # every admitted request complete, or ended by its deadline
    admitted = len(done) + len(expired)
    assert 64 < admitted <= QUEUE and len(refused) >= BURST - QUEUE, (len(done), len(expired), len(refused))
    for _, response in refused:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"
    assert max(t for t, _ in refused) < min(done + expired)  # refused at once, not after waiting in a queue
    for result in calls:
        assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED, result.code
        assert [(r.final, r.error.code) for r in result.responses] == [(True, "overloaded")]  # one final response
        assert (result.trailing["retry-after"], result.trailing["grpc-retry-pushback-ms"]) == ("1", "1000")
    assert [status for status, _ in probes] == [200] * HEALTH_PROBES
    print(
        f"burst of {BURST}: {admitted} admitted (at most {QUEUE}), {len(done)} complete and {len(expired)} past "
        f"their {deadline_s:g} s deadline, {len(refused)} refused; "
        f"slowest 429 {max(t for t, _ in refused):.2f} s; {GRPC_CALLS} gRPC calls, slowest RESOURCE_EXHAUSTED "
        f"{max(c.seconds for c in calls):.3f} s; /health with the queue full: slowest "
        f"{max(t for _, t in probes) * 1000:.0f} ms of {HEALTH_PROBES}"
    )
    rejected = len(refused) + GRPC_CALLS
    # Every 429 and RESOURCE_EXHAUSTED the clients saw is counted as rejected because the queue was full.
    await wait_until(
        lambda: counted(metrics_url, metrics.REJECTED, **labels) - rejected_before >= rejected,
        60,
        f"the rejected-requests counter grows by {rejected}",
    )
    assert counted(metrics_url, metrics.REJECTED, **labels) - rejected_before == rejected
