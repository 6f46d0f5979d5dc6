"""The Responses API's store rides through the loss of its primary: the production overlay's store
set (k8s/overlays/production/responses-store.yaml) loses its primary's Redis under a running
background answer and two readers, and the answer completes with every event read once, in order.

Real processes throughout: the set's three Redis and three Sentinels, started by the scripts its
ConfigMap ships (tests/e2e/harness/redis_set.py); the model replica's store as its builder makes it
from deploy/config.yaml's ``ingress.responses_store`` (a Sentinel's address, the primary's name, the
password as a file); the background answer, its lease renewals and its readers as the replica runs
them. Only the engine is a script of events. It uses none of the suite's applications
(``own_cluster``): under `make test` it runs beside the suite, with the unit tests.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from serve_app.config import ResponsesStoreConfig
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.answer_log.follow import follow
from serve_app.front_door.answer_log.store import event_type
from serve_app.front_door.core.background import produce_response
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.core.stored import StoredResponses
from tests.e2e.harness.redis_set import RESPONSES_SET, RedisSet
from tests.unit.front_door.stores import OWNER, ScriptedGeneration, event, response, unique
from tests.waiting import wait_until, wait_until_blocking
from tools.local_redis import stored_in_redis

pytestmark = pytest.mark.own_cluster

ROOT = Path(__file__).resolve().parents[2]
SET_UP_S = 60  # three Redis and three Sentinels find each other (Sentinel's gossip: every 2 s)
FAILOVER_S = 60  # the overlay's down-after (5 s) plus an election and a promotion
EVENTS = 30  # the answer's events before its last; the primary is lost after the tenth


@pytest.fixture
def redis_set(tmp_path_factory):
    redis = RedisSet(tmp_path_factory.mktemp("responses-store"), name=RESPONSES_SET)
    try:
        yield redis
    finally:
        redis.stop()


def shipped_store(redis_set: RedisSet) -> ResponsesStoreConfig:
    """deploy/config.yaml's ``ingress.responses_store``, its password file this set's."""
    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    (redis,) = stored_in_redis(config)
    return ResponsesStoreConfig.model_validate({"redis": redis | {"password_file": str(redis_set.password_file)}})


async def test_a_running_answer_and_two_readers_ride_through_the_loss_of_the_primary(redis_set, monkeypatch):
    """Pod 0's Redis (the primary) is killed after the answer's tenth event: its producer's appends,
    its lease renewals and both readers' reads wait while the Sentinels promote a replica, then go
    on against it; each reader gets the answer's events once, in order, to ``response.completed``,
    and the stored response ends ``completed``."""
    redis_set.start_all()
    first = redis_set.pods[0]
    wait_until_blocking(redis_set.set_up, SET_UP_S, "every Sentinel watching pod 0's primary, its replicas, each other")
    config = shipped_store(redis_set)
    assert config.redis is not None and config.redis.sentinel_master == redis_set.monitored
    monkeypatch.setenv(config.redis.url_env, f"redis://{redis_set.sentinels[1]}")  # (the Sentinels' Service)
    stored = StoredResponses.from_config(config)

    rid = unique("failover")
    queued = response(rid)
    completed = {"type": "response.completed", "sequence_number": EVENTS, "response": response(rid, "completed")}
    script = [event("response.output_text.delta", n) for n in range(EVENTS)]
    script.append(f"event: response.completed\ndata: {json.dumps(completed)}\n\n")
    lost = asyncio.Event()

    async def before(number: int) -> None:
        if number == 10:
            redis_set.kill(first, "redis")  # (as a node's loss ends it)
            lost.set()
        if number == 20:  # the rest once a replica is promoted: ten events were written while none was
            await wait_until(lambda: redis_set.promoted(first), FAILOVER_S, "a replica promoted by the Sentinels")

    generation = ScriptedGeneration(script, before)

    async def produce(get_permit) -> None:
        await produce_response(stored.patient, queued, get_permit, lambda _p, _d: generation, TimeLimits(600, 120))

    async def read() -> list[str]:
        return [logged async for logged in follow(stored.patient, queued, -1, stored.lease_s / 2)]

    try:
        save = stored.store.save(rid, OWNER, queued, [], background=True)
        await stored.background.start(rid, None, Permit(None), 1, save, produce)
        readers = [asyncio.create_task(read()) for _ in range(2)]
        await wait_until(lambda: lost.is_set(), 30, "the primary lost under the answer")
        read_by = await asyncio.wait_for(asyncio.gather(*readers), FAILOVER_S + config.redis.ride_through_s)
        for events in read_by:
            numbers = [json.loads(logged.partition("\ndata: ")[2])["sequence_number"] for logged in events]
            assert numbers == list(range(EVENTS + 1)), [event_type(logged) for logged in events[-3:]]
            assert events == script
        assert (await stored.store.load(rid, OWNER)).status == "completed"
    finally:
        await stored.close()
