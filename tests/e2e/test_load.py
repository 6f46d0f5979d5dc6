"""The serving layer under load, on the bed (the simulated engine, driven through its controls):
streaming, stream batching, abandoned streams and time limits. (A replica's queue bound, 429 past
it: test_direct_streaming.py, on ``direct``'s small queue.)

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

import httpx
import yaml

from benchmarks.client import carries_tokens
from serve_app.config import parse_app_config
from serve_app.front_door.telemetry import metrics
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import application
from tests.e2e.harness.bodies import LONG, chat
from tests.e2e.harness.streams import open_streams
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, increase, scrape, settled, total
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

    await wait_until(lambda: aborted() >= STREAMS, 60, f"{STREAMS} streams counted as aborted", every_s=SCRAPE_EVERY_S)
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
