"""A GPU worker pod's preStop hook, on real Ray: the node drains and no stream is cut.

One more Ray node (node A) joins the suite's cluster on this machine, standing in for a
GPU worker pod; the head stands in for a second. An application of the test's own
(``drain``: the bed's application, under ``/drain``) puts one model replica on each
(Serve's ``max_replicas_per_node: 1``). Its streams are admitted while both (simulated) engines are paused, one
by one until each replica holds four, so that a known share of them is held by the
replica on node A when the hook (``python -m serve_app.ops.node_drain``, as the pod runs
it) drains node A. Serve stops
that replica gracefully. The requests sent after Serve began stopping it are all
admitted by the other replica (read from each replica's own count while the engines are
still paused, so nothing can leave it), then the engines resume: every stream and
every request completes, and the hook returns once no Serve actor is left on node A,
not at the end of its grace period.

The hook starts while the GCS does not answer (its process stopped, as a head pod's restart
looks to a worker): it neither fails nor gives up, but asks again until the GCS is back, and
the drain then goes as above.

Serve cannot place a replacement here (the head holds its one replica; a draining node
gets nothing new), which is the case of a GPU cluster with no free GPU: the replica is then
stopped at the drain's deadline minus its graceful_shutdown_timeout_s, so the hook's
grace is set just above that timeout.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.harness.apps import application
from tests.e2e.harness.bodies import LONG, chat
from tests.e2e.harness.haproxy import watching_reloads
from tests.e2e.harness.ray_cluster import RayNode
from tests.e2e.harness.serve_state import (
    DeploymentName,
    live_replicas,
    ongoing_at,
    replica_states,
    running,
    serve_deploy,
    serve_deploy_settled,
)
from tests.e2e.harness.simulation import SimulatedEngines
from tests.waiting import wait_until

# After the rest: the drained node holds a router replica of every application still running
# (Serve starts one on each node with a replica), all moved by the drain; by then the variants
# are retired, so 3 start on the node and move, not 7.
pytestmark = pytest.mark.disruptive

HELD_EACH = 4  # streams each replica holds when node A is drained
MAX_STREAMS = 32  # sent one by one until each holds HELD_EACH: the model's limit is 64 each
AFTER_STOP = 8  # unary requests sent once Serve is stopping the drained node's replica
STOP_S = 120  # the drain app's graceful_shutdown_timeout_s (= its ingress.request_timeout_s)
GRACE_S = STOP_S + 5  # the hook's grace: Serve stops the replica at the deadline minus STOP_S
GCS_TIMEOUT_S = 3  # the hook's wait for an answer from the GCS before it asks again (production: 20 s)
MODEL = DeploymentName("drain", "model-glm-4-9b-chat")
MODEL_NAME = "glm-4-9b-chat"  # what the bed serves, and so the drain app


def drain_app(base: dict[str, Any]) -> dict[str, Any]:
    """The bed's application under another name and route, its two model replicas on two nodes
    and chosen by load (Serve's default router).

    Requests stay held for seconds here, so the first-token limit is longer than the bed's.
    """
    app = copy.deepcopy(base)
    app["name"], app["route_prefix"] = "drain", "/drain"
    (model,) = app["args"]["models"]
    # Its identical streams must be shared by both replicas: by prefix they would all go to
    # the one holding their prompt (up to prefix_routing.max_load_gap more than the other).
    model["prefix_routing"] = {"enabled": False}
    deployment = model["deployment"]
    deployment["num_replicas"] = 2
    deployment["ray_actor_options"] = {"num_cpus": 0}  # node A offers none
    deployment["max_replicas_per_node"] = 1
    deployment["graceful_shutdown_timeout_s"] = STOP_S
    ingress = app["args"]["ingress"]
    ingress["request_timeout_s"], ingress["first_token_timeout_s"] = STOP_S, 110
    return app


async def stream(client: httpx.AsyncClient) -> tuple[int, list[str]]:
    """One long stream through the drain app: its status and its data lines."""
    events = []
    async with client.stream("POST", "/drain/v1/chat/completions", json=chat(MODEL_NAME, LONG, stream=True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return r.status_code, events


async def test_a_drained_node_finishes_its_streams_while_new_requests_go_elsewhere(
    sim_app, ray_cluster, cluster, tmp_path
):
    app = sim_app
    config = yaml.safe_load(app.config_path.read_text())
    both = copy.deepcopy(config)
    both["applications"].append(drain_app(application(config, app.name)))
    both_path = tmp_path / "with-drain-app.yaml"
    both_path.write_text(yaml.safe_dump(both, sort_keys=False))
    # Every Serve application has a router replica on each node that holds a replica (Serve's
    # ingress request router): a second extra node would start one of each application's.
    node_a = RayNode(ray_cluster, "a", {"drain_test_node_a": 1})
    hook: asyncio.subprocess.Process | None = None
    try:
        a_id = await asyncio.to_thread(node_a.start)
        await serve_deploy(both_path, cluster)
        await wait_until(lambda: running(MODEL, 2), 120, "the drain app's two model replicas running, one per node")
        replicas = await live_replicas(MODEL)
        ((victim,),) = [(a,) for a, node in replicas.items() if node == a_id]
        (other,) = set(replicas) - {victim}

        async def holding() -> tuple[int, int]:
            """Requests each replica is answering (held: their engines are paused)."""
            return await ongoing_at(victim), await ongoing_at(other)

        limits = httpx.Limits(max_connections=MAX_STREAMS + AFTER_STOP)
        async with (
            httpx.AsyncClient(base_url=app.origin, timeout=300, limits=limits) as client,
            watching_reloads() as reloads,
        ):
            async with SimulatedEngines(MODEL).paused():
                streams: list[asyncio.Task[tuple[int, list[str]]]] = []
                while min(held_by_each := await holding()) < HELD_EACH:
                    # One at a time, each admitted before the next, so the router's choice between
                    # two held replicas is by their counts: it shares them out as soon as it knows both.
                    assert len(streams) < MAX_STREAMS, f"{len(streams)} streams sent, held: {held_by_each}"
                    streams.append(asyncio.create_task(stream(client)))

                    async def admitted(sent: int = len(streams)) -> bool:
                        return sum(await holding()) == sent

                    await wait_until(admitted, 30, f"stream {len(streams)} held by a replica")
                held, held_elsewhere = await holding()
                started, drain_from = time.monotonic(), time.time()
                hook_log = tmp_path / "hook.log"
                gcs = gcs_server_pid(ray_cluster.gcs_port)
                os.kill(gcs, signal.SIGSTOP)
                try:
                    with hook_log.open("wb") as log:
                        hook = await asyncio.create_subprocess_exec(
                            sys.executable,
                            "-m",
                            "serve_app.ops.node_drain",
                            "--node-id",
                            a_id,
                            "--grace-s",
                            str(GRACE_S),
                            "--gcs-timeout-s",
                            str(GCS_TIMEOUT_S),
                            env=os.environ | ray_cluster.env,
                            stdout=log,
                            stderr=asyncio.subprocess.STDOUT,
                        )
                    await wait_until(
                        lambda: b"could not ask the GCS to drain the node" in hook_log.read_bytes(),
                        60,
                        "the hook's first drain request unanswered",
                    )
                    assert hook.returncode is None  # it waits: neither failed nor gave up
                finally:
                    os.kill(gcs, signal.SIGCONT)
                await wait_until(_stopping, 60, "Serve stopping the drained node's replica")
                # Serve takes a stopping replica out of HAProxy's backends by reloading it: requests
                # sent before the new HAProxy process runs may still reach the stopping replica (which
                # answers them, as its drain lets it; seen in two CI runs here), so they wait for it.
                await wait_until(
                    lambda: reloads.first_after(drain_from) is not None, 60, "HAProxy reloaded after the drain began"
                )
                body = chat(app.model, 16)
                after = [
                    asyncio.create_task(client.post("/drain/v1/chat/completions", json=body)) for _ in range(AFTER_STOP)
                ]

                async def all_admitted_elsewhere() -> bool:
                    return await holding() == (held, held_elsewhere + AFTER_STOP)

                # Still paused, so whatever a replica admits stays in its count: all went to the other.
                try:
                    await wait_until(
                        all_admitted_elsewhere, 30, f"the other replica holding the {AFTER_STOP} new requests"
                    )
                except AssertionError as failed:  # where they went instead (drained, other)
                    raise AssertionError(f"{failed}; held {await holding()}, from {(held, held_elsewhere)}") from None
            # The engines resume: the stopping replica finishes what it holds.
            results = await asyncio.gather(*streams)
            answers = await asyncio.gather(*after)
        await asyncio.wait_for(hook.wait(), timeout=GRACE_S + 30)
        output = hook_log.read_bytes()
        took = time.monotonic() - started

        for status, events in results:
            assert status == 200 and events[-1] == "[DONE]", (status, events[-2:])
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length", events[-3:]
        assert [a.status_code for a in answers] == [200] * AFTER_STOP, [a.text for a in answers]
        assert hook.returncode == 0, output.decode()
        # It returned because nothing was left on the node, not because its grace period ran out.
        assert b"no Serve actor left" in output, output.decode()
        assert b"could ask the GCS to drain the node after" in output, output.decode()
        assert (await live_replicas(MODEL)).get(victim) is None  # it left
        print(
            f"{held} of {len(streams)} streams held by the drained node's replica ({held_elsewhere} by the other); all "
            f"complete; {AFTER_STOP} later requests all went to the other; the hook returned after {took:.0f} s "
            f"of {GRACE_S}"
        )
    finally:
        if hook is not None and hook.returncode is None:
            hook.kill()
        await serve_deploy_settled(app.config_path, cluster, settled=set())  # the drain app goes
        await asyncio.to_thread(node_a.stop)


def gcs_server_pid(port: int) -> int:
    """The process of the suite cluster's GCS (the one listening on ``port``)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not a process
        if argv[0].endswith(b"gcs_server") and f"--gcs_server_port={port}".encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no gcs_server process with port {port}")


async def _stopping() -> bool:
    return (await replica_states(MODEL)).get("STOPPING", 0) >= 1
