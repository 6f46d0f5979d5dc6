"""The ``prefix`` application under a bare ``serve run``: a Ray cluster of its own, started with Ray's
defaults (no deploy/cluster.env, so no HAProxy). Serve's Python proxy picks a model replica by load,
and that replica asks the ReplicaPicker where the parsed request runs, answering it or sending it
on: conversations find their history cached as they do behind HAProxy (test_prefix_routing.py).

It uses none of the suite's applications (``own_cluster``): under `make test` it runs beside the
suite, with the unit tests (docs/testing.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.harness.apps import application, suite_config
from tests.e2e.harness.conversations import check_turns
from tests.e2e.harness.ray_cluster import free_port
from tests.e2e.harness.serve_run import serve_run_alone
from tools.local_redis import LocalRedis

pytestmark = pytest.mark.own_cluster

BARE_START_S = 300  # a backstop over the cluster's start and its two replicas' (about a minute)


@pytest.fixture(scope="module")
def bare_serve_run(tmp_path_factory) -> Iterator[str]:
    """The suite's ``prefix`` application alone, on ports of its own, its stored responses in a Redis
    of its own; yields its URL."""
    workdir = tmp_path_factory.mktemp("bare")
    redis = LocalRedis(workdir / "redis").start()
    try:
        port, grpc_port = free_port(), free_port()
        suite = suite_config(port, grpc_port, redis.env(), workdir)
        prefix = application(suite, "prefix")
        with serve_run_alone(suite, prefix, workdir, BARE_START_S) as url:
            yield url
    finally:
        redis.stop()


async def test_under_a_bare_serve_run_turns_find_their_history_cached(bare_serve_run):
    """Without HAProxy the replica Serve's proxy picked (by load) asks the ReplicaPicker which replica
    answers, and answers or sends the request on."""
    async with httpx.AsyncClient(base_url=bare_serve_run, timeout=120) as client:
        await check_turns(client)
