"""The GCS's store has no single pod: the production overlay's Redis set loses its primary, and the
head's state survives (k8s/overlays/production/redis.yaml; docs/kubernetes.md, "Head fault tolerance").

Real processes throughout: the set's three Redis and three Sentinels, started by the scripts its
ConfigMap ships (tests/e2e/harness/redis_set.py), and a Ray head of its own started as KubeRay
starts one with GCS fault tolerance: the Redis address (here a Sentinel, as the overlay gives the
Sentinels' Service), the password, a storage namespace. It uses none of the suite's applications
(``own_cluster``): under `make test` it runs beside the suite, with the unit tests (docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.harness.ray_cluster import RayCluster
from tests.e2e.harness.redis_set import RedisSet
from tests.waiting import wait_until_blocking

pytestmark = pytest.mark.own_cluster

SET_UP_S = 60  # three Redis and three Sentinels find each other (Sentinel's gossip: every 2 s)
FAILOVER_S = 60  # the overlay's down-after (5 s) plus an election and a promotion
GCS_EXIT_S = 60  # the GCS pings its Redis every few seconds, and exits after five failures

KEEPER = """
import sys
import ray

ray.init(logging_level="ERROR")

@ray.remote
class Keeper:
    def ping(self):
        return "pong"

if sys.argv[1] == "make":
    keeper = Keeper.options(name="keeper", namespace="gcs-store", lifetime="detached", max_restarts=-1).remote()
else:
    keeper = ray.get_actor("keeper", namespace="gcs-store")
print(ray.get(keeper.ping.remote(), timeout=60))
"""


@pytest.fixture
def redis_set(tmp_path_factory):
    redis = RedisSet(tmp_path_factory.mktemp("redis"))
    try:
        yield redis
    finally:
        redis.stop()


def keeper(cluster: RayCluster, step: str) -> str:
    """Make the detached actor, or find it; its answer."""
    done = subprocess.run(
        [sys.executable, "-c", KEEPER, step], env=os.environ | cluster.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_head_keeps_its_state_when_the_redis_primary_is_lost(redis_set):
    """Pod 0's Redis (the first primary) is killed: the Sentinels promote a replica, the GCS exits
    (as its container would, to be restarted), the old primary returns as a replica, and the
    restarted head finds the detached actor it had."""
    redis_set.start_all()
    first = redis_set.pods[0]
    wait_until_blocking(redis_set.set_up, SET_UP_S, "every Sentinel watching pod 0's primary, its replicas, each other")

    cluster = RayCluster(
        settings={
            # What KubeRay gives the head with gcsFaultToleranceOptions (and --redis-password).
            "RAY_REDIS_ADDRESS": redis_set.sentinels[1],
            "RAY_external_storage_namespace": "glm4-serve-test",
            # Ray's default, else: the node's own drain at its stop (30 s; nothing is left to move then).
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        },
        start_args=("--redis-password", redis_set.password),
    )
    try:
        cluster.start_as_a_pod()
        assert keeper(cluster, "make") == "pong"

        redis_set.kill(first, "redis")

        promoted = wait_until_blocking(
            lambda: redis_set.promoted(first),
            FAILOVER_S,
            "a replica promoted by the Sentinels",
        )
        head = cluster.process
        assert head is not None
        wait_until_blocking(lambda: head.poll() is not None, GCS_EXIT_S, "the head's GCS gone with its Redis")

        # The old primary's pod restarts: its script asks the Sentinels, and it follows the new primary.
        redis_set.start(first, "redis")
        wait_until_blocking(
            lambda: redis_set.role(first).get("master_port") == str(promoted)
            and redis_set.role(first).get("master_link_status") == "up",
            FAILOVER_S,
            "the old primary back as a replica of the new one",
        )

        cluster.start_as_a_pod()  # the head pod's restart
        assert keeper(cluster, "find") == "pong"
    finally:
        cluster.stop()
