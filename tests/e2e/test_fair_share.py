"""Fair share between API keys on the bed's variants (one replica, direct streaming, fair share on
as shipped): ``glm-keyed`` with two keys, ``glm-limited`` with them held to 2 requests at once
(tests/e2e/harness/apps.py), and each key's limit on requests at once.

Key A's flood fills the replica's batch and queue; key B's one request does not wait behind A's
waiting requests. The engine is paused while they arrive, so what it holds is exactly what was
sent, in the order sent: A's 160 requests, ranked 0 to 159 by the places A held as each came,
then B's, ranked 0. Resumed, the engine runs 64 at a time: B's is in the first 64 (rank 0 after
A's first), where arrival order (first come, first served) would have put it last, behind A's 96
waiting requests. Every request of both keys completes in full.

With ``rate_limits.max_concurrent_requests`` a key past its requests at once gets 429 while
another key's request goes ahead; the places come back as requests end. The 429 comes before
any work the request's body would cost: one whose grammar takes minutes to build (a 400
``grammar_too_costly`` once built, with its checker process killed) still gets the key's 429,
and no grammar build is counted for it (``glm4_serve_grammar_builds_total``: the next request's
is). With the shared
limiter unreachable (its one replica cannot be placed), the replica holds each key to the
limit itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
import yaml

from serve_app.front_door.telemetry import metrics
from tests.e2e.harness.apps import FLOOD_KEY, LIGHT_KEY, application
from tests.e2e.harness.bodies import chat
from tests.e2e.harness.serve_state import only_one_running, serve_deploy_preserving
from tests.e2e.harness.simulation import Bed, ready_bed
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, increase, scrape, settled
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("glm-keyed", "glm-limited")

FLOOD = 160  # more than the replica runs at once (64): 96 wait
RUNS_AT_ONCE = 64  # the bed's batch (max_num_seqs)
FLOOD_TOKENS = 128  # each wave of A's answers takes 128 engine steps
LIGHT_TOKENS = 8


@pytest.fixture
async def keyed_bed(variants) -> Bed:
    """``glm-keyed``: the bed with API keys (and so fair share)."""
    return await ready_bed(variants["glm-keyed"])


@pytest.fixture
async def limited_bed(variants) -> Bed:
    """``glm-limited``: the keyed bed, each key held to 2 requests at once by the rate limiter."""
    return await ready_bed(variants["glm-limited"])


async def streamed(client: httpx.AsyncClient, key: str, tokens: int, model: str) -> tuple[int, float, bool]:
    """Stream one answer: its status, when its first event came (monotonic), and whether it ran to
    its ``tokens`` (finish_reason "length", then ``[DONE]``)."""
    body = chat(model, tokens, stream=True)
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        first, finished, done = float("inf"), False, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                first = min(first, time.monotonic())
                event = json.loads(line.removeprefix("data: "))
                finished |= any(c.get("finish_reason") == "length" for c in event.get("choices", []))
        return response.status_code, first, finished and done


async def flood_then_light(
    bed, flood_arrived: Callable[[], Awaitable[object]], light_arrived: Callable[[], Awaitable[object]]
) -> int:
    """With the engines paused, key A's flood, then key B's one request once ``flood_arrived``
    returns; resumed once ``light_arrived`` returns. Every request of both completes in full;
    returns how many of A's started after B's."""
    limits = httpx.Limits(max_connections=FLOOD + 8, max_keepalive_connections=FLOOD + 8)
    async with httpx.AsyncClient(base_url=bed.app.url, timeout=120, limits=limits) as client:
        async with bed.engines.paused():
            flood = [
                asyncio.create_task(streamed(client, FLOOD_KEY, FLOOD_TOKENS, bed.app.model)) for _ in range(FLOOD)
            ]
            await flood_arrived()
            light = asyncio.create_task(streamed(client, LIGHT_KEY, LIGHT_TOKENS, bed.app.model))
            await light_arrived()
        flooded, (light_status, light_first, light_complete) = await asyncio.gather(*flood), await light
    assert (light_status, light_complete) == (200, True)
    assert [(status, complete) for status, _, complete in flooded] == [(200, True)] * FLOOD  # the flood's too
    return sum(1 for _, first, _ in flooded if first > light_first)


async def test_a_flood_by_one_key_does_not_make_another_keys_request_wait_behind_it(keyed_bed):
    bed = keyed_bed
    started_after_light = await flood_then_light(
        bed, lambda: bed.engines.wait_until_holding(FLOOD), lambda: bed.engines.wait_until_holding(FLOOD + 1)
    )
    print(f"direct streaming: {started_after_light} of the flood's {FLOOD} requests started after the light key's")
    # The 96 that waited for a second wave (first come, first served: none).
    assert started_after_light >= FLOOD - RUNS_AT_ONCE, started_after_light


async def test_a_key_past_its_requests_at_once_is_refused_by_the_limiter_or_without_it_by_the_replica(
    limited_bed, cluster, tmp_path, metrics_url
):
    bed = limited_bed
    builds = f"ray_{metrics.GRAMMAR_BUILDS}_total"
    before = await settled(metrics_url, builds)
    await _two_at_once_then_refused(bed)
    # The refused request's grammar was never built: the only build counted is the next one's.
    async with httpx.AsyncClient(base_url=bed.app.url, timeout=120) as client:
        built = await client.post(
            "/v1/chat/completions",
            json=chat(bed.app.model, 4, response_format={"type": "json_object"}),
            headers={"Authorization": f"Bearer {LIGHT_KEY}"},
        )
    assert built.status_code == 200, built.text

    def counted() -> float:
        return increase(before, scrape(metrics_url), builds, application=bed.app.name)

    await wait_until(lambda: counted() >= 1, 60, "the next request's grammar build counted", every_s=SCRAPE_EVERY_S)
    after = scrape(metrics_url)
    assert increase(before, after, builds, application=bed.app.name) == 1
    assert increase(before, after, builds, application=bed.app.name, outcome="built") == 1
    # The limiter's one replica asks for a resource no node has: it never starts, and each
    # admission gives up on it after 2 s.
    before = set(await bed.engines.replicas())
    config = yaml.safe_load(bed.app.config_path.read_text())
    ingress = application(config, bed.app.name)["args"]["ingress"]
    ingress["rate_limits"]["deployment"] |= {"ray_actor_options": {"resources": {"nowhere": 1}}}
    unplaceable = tmp_path / "limiter-unplaceable.yaml"
    unplaceable.write_text(yaml.safe_dump(config, sort_keys=False))
    # It stays so: test_answers_as_work, after it, holds a key to its cap without the limiter (the
    # replica's own count of the key's requests, as this test's second half proves).
    await serve_deploy_preserving(unplaceable, bed.app.config_path, cluster)

    async def replaced() -> bool:
        return await only_one_running(bed.model) and not set(await bed.engines.replicas()) & before

    await wait_until(replaced, 120, "the model replica replaced, the limiter left pending")
    await _two_at_once_then_refused(bed)


# A grammar llguidance builds item by item, for minutes: the front door's build stops at
# ingress.max_grammar_build_s with a 400, if it ever starts.
COSTLY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "costly", "schema": {"type": "array", "maxItems": 1_000_000_000}},
}


async def _two_at_once_then_refused(bed) -> None:
    """Key A's third request while two are held, one whose grammar would cost minutes to build:
    429 naming requests at once, no build tried; key B's goes ahead; once A's end, A's next is answered."""
    async with httpx.AsyncClient(base_url=bed.app.url, timeout=120) as client:
        async with bed.engines.paused():
            held = [asyncio.create_task(streamed(client, FLOOD_KEY, 4, bed.app.model)) for _ in range(2)]
            await bed.engines.wait_until_holding(2)
            refused = await client.post(
                "/v1/chat/completions",
                json=chat(bed.app.model, 4, response_format=COSTLY_FORMAT),
                headers={"Authorization": f"Bearer {FLOOD_KEY}"},
            )
            other = asyncio.create_task(streamed(client, LIGHT_KEY, 4, bed.app.model))
            await bed.engines.wait_until_holding(3)
        assert [(status, complete) for status, _, complete in await asyncio.gather(*held, other)] == [(200, True)] * 3
        after = await after_retries(client, bed.app.model)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests at once" in error["message"]
    assert after[0] == 200 and after[2]


async def after_retries(client: httpx.AsyncClient, model: str, attempts: int = 3) -> tuple[int, float, bool]:
    """Key A's next request, sent again after each 429's Retry-After as a client would: a request's
    place is given back as its replica ends it, which can be just after its client read the end."""
    for _ in range(attempts - 1):
        response = await client.post(
            "/v1/chat/completions", json=chat(model, 4), headers={"Authorization": f"Bearer {FLOOD_KEY}"}
        )
        if response.status_code != 429:
            break
        await asyncio.sleep(int(response.headers["retry-after"]))
    return await streamed(client, FLOOD_KEY, 4, model)
