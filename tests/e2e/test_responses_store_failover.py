"""The Responses API's store rides through the loss of its primary: the production overlay's store
set (k8s/overlays/production/responses-store.yaml) loses its primary's Redis under a running
background answer and two readers, and the answer runs to its end with every event read once, in order.

Real processes throughout: the set's three Redis and three Sentinels, started by the scripts its
ConfigMap ships (tests/e2e/harness/redis_set.py), and the suite's ``prefix`` application under a
bare ``serve run`` on a Ray cluster of its own (as test_bare_serve_run.py starts it), its store
deploy/config.yaml's ``ingress.responses_store`` (a Sentinel's address, the primary's name, the
password as a file, the shipped lease and expiry). Its simulated engine loads in a second and
makes a token every 50 ms, so the answer outlasts the failover. It uses none of the suite's
applications (``own_cluster``): under `make test` it runs beside the suite, with the unit tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.harness.apps import application, suite_config
from tests.e2e.harness.ray_cluster import free_port
from tests.e2e.harness.redis_set import RESPONSES_SET, RedisSet
from tests.e2e.harness.serve_run import serve_run_alone
from tests.waiting import wait_until, wait_until_blocking
from tools.local_redis import stored_in_redis

pytestmark = pytest.mark.own_cluster

ROOT = Path(__file__).resolve().parents[2]
SET_UP_S = 60  # three Redis and three Sentinels find each other (Sentinel's gossip: every 2 s)
FAILOVER_S = 60  # the overlay's down-after (5 s) plus an election and a promotion
START_S = 300  # a backstop over the cluster's start and its replica's
TOKENS = 600  # at a token each 50 ms: half a minute, past the failover
LOST_AT = 20  # the primary is killed once the first reader has this many events
PASSWORD_ENV = "RESPONSES_STORE_PASSWORD"


def shipped_store(password_file: Path) -> dict:
    """deploy/config.yaml's ``ingress.responses_store``, its password file this set's."""
    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    (redis,) = stored_in_redis(config)
    return {"redis": redis | {"password_file": str(password_file)}}


@pytest.fixture(scope="module")
def failover_bed(tmp_path_factory) -> Iterator[tuple[str, RedisSet]]:
    """The Redis set, and ``prefix`` (one replica) keeping its answers there; yields its URL and the set."""
    workdir = tmp_path_factory.mktemp("failover")
    redis_set = RedisSet(workdir / "redis", name=RESPONSES_SET)
    try:
        redis_set.start_all()
        wait_until_blocking(redis_set.set_up, SET_UP_S, "every Sentinel watching pod 0's primary, its replicas")
        port, grpc_port = free_port(), free_port()
        store = shipped_store(redis_set.password_file)
        suite = suite_config(port, grpc_port, {store["redis"]["url_env"]: f"redis://{redis_set.sentinels[1]}"}, workdir)
        prefix = application(suite, "prefix")
        (model,) = prefix["args"]["models"]
        model["deployment"]["num_replicas"] = 1
        model["simulated_engine"] |= {"load_s": 1.0, "step_launch_ms": 50.0}
        prefix["args"]["ingress"]["responses_store"] = store
        with serve_run_alone(suite, prefix, workdir, START_S) as url:
            yield url, redis_set
    finally:
        redis_set.stop()


async def events(response: httpx.Response) -> AsyncIterator[dict]:
    """An SSE stream's events' data, as they come."""
    async for block in _blocks(response):
        data = block.partition("data: ")[2]
        yield json.loads(data)


async def _blocks(response: httpx.Response) -> AsyncIterator[str]:
    buffered = ""
    async for text in response.aiter_text():
        buffered += text
        *blocks, buffered = buffered.split("\n\n")
        for block in blocks:
            if block.strip():
                yield block


async def test_a_background_answer_and_two_readers_ride_through_the_loss_of_the_primary(failover_bed):
    """Pod 0's Redis (the primary) is killed once the first reader has 20 events and the second one: the answer's
    appends, its lease renewals and both readers' reads wait while the Sentinels promote a replica
    (its lease lapses meanwhile: readers give its replica the grace to renew it), then go on; each
    reader gets every event once, in order, to the answer's end (``response.incomplete``: it ran to its
    ``max_output_tokens``), and the response is kept so."""
    url, redis_set = failover_bed
    first = redis_set.pods[0]
    body = {"model": "glm-4-9b-chat", "input": "Tell me a story.", "max_output_tokens": TOKENS}
    body |= {"background": True, "stream": True}
    read: dict[str, list[dict]] = {"poster": [], "getter": []}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30, read=FAILOVER_S)) as client:

        async def follow(name: str, response: httpx.Response) -> None:
            async for data in events(response):
                read[name].append(data)
                if len(read["poster"]) >= LOST_AT and read["getter"] and "redis" in first.processes:
                    redis_set.kill(first, "redis")  # (as a node's loss ends it)

        async with client.stream("POST", "/v1/responses", json=body) as posted:
            assert posted.status_code == 200
            poster = asyncio.create_task(follow("poster", posted))
            await wait_until(lambda: read["poster"], 60, "the answer's first event")
            response_id = read["poster"][0]["response"]["id"]
            # (opened before the loss: a call that needs the store while it is down is a 503 by design)
            async with client.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true"}) as got:
                assert got.status_code == 200
                await asyncio.wait_for(asyncio.gather(poster, follow("getter", got)), 300)

        async def ended() -> dict | None:  # (its object is kept final just after its last event is logged)
            stored = (await client.get(f"/v1/responses/{response_id}")).json()
            return stored if stored["status"] != "in_progress" else None

        stored = await wait_until(ended, 30, "the answer's object kept as it ended")
    for name, datas in read.items():
        assert [data["sequence_number"] for data in datas] == list(range(len(datas))), name
        assert datas[-1]["type"] == "response.incomplete", (name, datas[-1])  # (its whole max_output_tokens)
        assert datas[-1]["response"]["usage"]["output_tokens"] == TOKENS
    assert stored["status"] == "incomplete" and stored["incomplete_details"]["reason"] == "max_output_tokens"
    assert redis_set.promoted(first) is not None, "the answer ended before a replica was promoted: nothing proven"
    print(f"{len(read['poster'])} events to each reader; the primary lost after the {LOST_AT}th")
