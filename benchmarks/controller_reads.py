"""What one read of Serve's state costs its controller, on a running cluster of this machine.

Two reads, each called ``--calls`` times one after another, in CPU milliseconds of the
controller's process per call, its background (the control loop, other callers) over as long
a wall time subtracted:

- ``instance``: ``get_serve_instance_details``, the report of every application that
  ``serve.status()`` and ``serve status`` parse (and which each model replica's readiness watch
  read once a second before it asked for its own deployment only);
- ``deployment``: ``get_deployment_details`` of one deployment, what the readiness watch asks
  now (``serve_app.serve_internals.replica_states``).

The controller must run on this machine (its CPU is read from ``/proc``)::

    RAY_ADDRESS=127.0.0.1:6379 python -m benchmarks.controller_reads --app glm --deployment model-glm-4-9b-chat
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import psutil
import ray


def controller_cpu_ms_per_call(controller: psutil.Process, call: Callable[[], Any], calls: int) -> float:
    """The controller's CPU per call, its CPU over an idle window as long as the calls took subtracted."""

    def cpu_s() -> float:
        times = controller.cpu_times()
        return times.user + times.system

    started_cpu, started = cpu_s(), time.monotonic()
    for _ in range(calls):
        call()
    busy_cpu, took = cpu_s() - started_cpu, time.monotonic() - started
    idle_from = cpu_s()
    time.sleep(took)
    background = cpu_s() - idle_from
    return 1000 * max(busy_cpu - background, 0.0) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", default="glm", help="the application whose deployment is read")
    parser.add_argument("--deployment", default="model-glm-4-9b-chat")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    ray.init(namespace="serve", log_to_driver=False)
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    process = psutil.Process(ray.get(controller.get_pid.remote()))
    reads: dict[str, Callable[[], Any]] = {
        "instance": lambda: ray.get(controller.get_serve_instance_details.remote()),
        "deployment": lambda: ray.get(controller.get_deployment_details.remote(args.app, args.deployment)),
    }
    applications = len(ray.get(controller.get_serve_instance_details.remote()).get("applications") or {})
    print(f"{applications} applications; the controller's CPU per call, {args.calls} calls each:")
    for name, call in reads.items():
        print(f"  {name:>10}: {controller_cpu_ms_per_call(process, call, args.calls):6.1f} ms")


if __name__ == "__main__":
    main()
