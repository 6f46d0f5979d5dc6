"""Drain this Ray node before its pod goes: the worker pods' preStop hook (GPU and CPU).

Kubernetes runs a pod's preStop hook, then sends SIGTERM, and kills what is left once
``terminationGracePeriodSeconds`` have passed since the start. Without a hook, Serve keeps
routing new requests to the pod's replicas until Ray notices the node is gone, and the kill
cuts every stream they were answering.

The hook asks Ray's GCS to drain the node (``ray drain-node``, the API Ray's autoscaler
uses for nodes it removes) with a deadline at the end of the grace period. Ray then places
nothing new there, and Serve migrates the node's replicas: it starts replacements
elsewhere and stops the old ones gracefully (no new requests; each finishes its streams
within ``graceful_shutdown_timeout_s``), at the latest at the deadline minus that timeout.
A proxy on the node drains too (its health check fails, so the Serve Service stops
sending it connections) and leaves once idle. The hook returns as soon as no Serve
actor is left on the node, or at the deadline, so an idle pod goes at once::

    python -m serve_app.ops.node_drain --grace-s 950 [--node-id HEX] [--address HOST:PORT]

Without the GCS (the head pod is gone or restarting) it fails safe: each call to the GCS that
does not answer within ``--gcs-timeout-s`` is tried again until the deadline, while the
pod's replicas go on serving (they need no GCS for that). When the GCS returns, the drain
goes on as above; if it does not return in time, the pod stops at the grace period's end,
as late as Kubernetes allows, never early.

It talks to Ray with the pod's Ray token (``RAY_AUTH_*``, set by KubeRay).

Runs in each worker pod's preStop hook, beside the pod's Ray node.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger("serve_app.ops.node_drain")

POLL_S = 1.0  # between looks at the node's Serve actors; Serve's own loop is slower
RETRY_S = 2.0  # between calls to a GCS that did not answer
GCS_TIMEOUT_S = 20.0  # a call to the GCS that has not answered by then is made again
SERVE_ACTOR_PREFIXES = ("ServeReplica:", "ProxyActor")

T = TypeVar("T")

NODE_ID = """
import logging
import sys
import ray

ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
print(ray.get_runtime_context().get_node_id())
"""


def this_node_id(address: str, timeout_s: float) -> str:
    """The id of the Ray node in this pod (as ``ray drain-node`` finds it by default).

    Asked in a process of its own, ended after ``timeout_s``: ``ray.init`` waits long for a
    GCS that does not answer, and cannot be cancelled in-process."""
    found = subprocess.run(
        [sys.executable, "-c", NODE_ID, address], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return found.stdout.strip().splitlines()[-1]


def request_drain(node_id: str, address: str, deadline_s: int, timeout_s: float) -> str:
    """Ask Ray to drain ``node_id``, to be gone in ``deadline_s`` (a preemption: always accepted);
    the CLI is ended after ``timeout_s``. Returns the node's id once the GCS accepted."""
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run(
        [
            str(ray_cli) if ray_cli.exists() else "ray",
            "drain-node",
            "--address",
            address,
            "--node-id",
            node_id,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            "its Kubernetes pod is terminating",
            "--deadline-remaining-seconds",
            str(deadline_s),
        ],
        check=True,
        timeout=timeout_s,
    )
    return node_id


def until_answered(
    call: Callable[[], T],
    what: str,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> T | None:
    """``call``'s result, made again while it fails, until ``deadline`` (None then).

    A failure is a GCS away (the head pod restarting) as often as a fault: the pod keeps
    serving meanwhile, so waiting costs nothing that giving up would not cut."""
    failures = 0
    while True:
        try:
            result = call()
        except Exception as exc:  # an unreachable GCS shows as a timeout or as the CLI's error
            failures += 1
            if failures == 1:
                logger.warning("could not %s (%s); trying again until the grace period's end", what, exc)
        else:
            if failures:
                logger.info("could %s after %d failed tries", what, failures)
            return result
        if clock() + RETRY_S >= deadline:
            return None
        sleep(RETRY_S)


def default_address() -> str:
    """Where the GCS is: ``RAY_ADDRESS``, else the head KubeRay names in a worker pod, else Ray's own lookup."""
    if address := os.environ.get("RAY_ADDRESS"):
        return address
    if (head := os.environ.get("FQ_RAY_IP")) and (port := os.environ.get("RAY_PORT")):
        return f"{head}:{port}"
    return "auto"


def serve_actors_on(node_id: str) -> list[str]:
    """The class names of the live Serve replicas and proxies on ``node_id``."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")], limit=10_000)
    return [a.class_name for a in actors if a.class_name.startswith(SERVE_ACTOR_PREFIXES)]


def wait_until_empty(
    look: Callable[[], list[str]],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> list[str] | None:
    """Poll ``look`` until it finds nothing or ``deadline`` passes; return what is left.

    A look that fails (Ray's state API unreachable for a moment) proves nothing: the wait
    goes on, so that streams are never cut on a guess. None means no look succeeded.
    """
    left: list[str] | None = None
    while True:
        try:
            left = look()
        except Exception as exc:  # any failure to look is a reason to keep waiting
            logger.warning("could not list the node's Serve actors (%s); still waiting", exc)
        else:
            if not left:
                return left
            logger.info("waiting for %d Serve actors on this node: %s", len(left), ", ".join(sorted(set(left))))
        if clock() >= deadline:
            return left
        sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.ops.node_drain", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--grace-s",
        type=int,
        required=True,
        help="Seconds the pod may still take (its terminationGracePeriodSeconds, less a margin for SIGTERM).",
    )
    parser.add_argument("--node-id", help="The Ray node to drain (default: the one in this pod).")
    parser.add_argument("--address", default=default_address(), help="The Ray cluster's GCS (host:port).")
    parser.add_argument(
        "--gcs-timeout-s",
        type=float,
        default=GCS_TIMEOUT_S,
        help="A call to the GCS not answered within this is made again (until the grace period's end).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node_drain %(message)s")
    deadline = time.monotonic() + args.grace_s
    timeout_s = args.gcs_timeout_s
    found = args.node_id or until_answered(
        lambda: this_node_id(args.address, timeout_s), "find this pod's Ray node", deadline
    )
    node_id = found and until_answered(
        lambda: request_drain(found, args.address, max(1, int(deadline - time.monotonic())), timeout_s),
        "ask the GCS to drain the node",
        deadline,
    )
    if not node_id:
        logger.warning("the GCS did not answer within the grace period: the pod served until its end")
        return 0
    logger.info("draining Ray node %s: Serve moves its replicas, which finish their streams", node_id)
    left = wait_until_empty(lambda: serve_actors_on(node_id), deadline)
    if left == []:
        logger.info("no Serve actor left on node %s: the pod may go", node_id)
    else:
        logger.warning("the grace period ends with Serve actors on the node (or unknown): %s", left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
