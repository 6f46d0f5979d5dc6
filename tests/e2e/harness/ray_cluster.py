"""The test suite's own Ray cluster: its own temp dir, ports and token, nothing of the user's.

`make serve` and a plain `serve run` use the user's Ray setup (``/tmp/ray``,
``~/.ray/auth_token``, port 6379). The suite must neither change that setup nor
join a cluster the user left running, so it starts a head node of its own, with
token authentication on as `make serve` has it, a token in its temp dir
(``RAY_AUTH_TOKEN_PATH``), free ports, and ``--block`` so that stopping that one
process stops exactly this cluster (``ray stop`` would stop every cluster on the
machine).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.waiting import wait_until_blocking
from tools.cluster_env import cluster_env

START_TIMEOUT_S = 120
# The lines of a replica's or an engine process's log that say why an engine stopped answering.
ENGINE_FAILURE = re.compile(
    r"taken as hung|vLLM engine died|EngineDeadError|EngineCore.*(ERROR|Error|Traceback|Killed)"
)
# A traceback's frames and markers in vLLM's log lines (``[core.py:1512]   File ...``, its
# source lines and ``^^^``, ``Traceback (most recent call last):``): left out of what is printed.
TRACEBACK_FRAME = re.compile(r"\[\S+:\d+\] (\s|\^|Traceback)")

# Ray's metrics export interval in the suite's cluster (production: Ray's default, 10 s). The
# tests that read metrics wait for an interval or two; they read it from here. Ray's agent drops
# a gauge not exported for two intervals: at 2 s, series of idle replicas flickered out under the
# suite's load (a loaded process exports late), so 5 s.
METRICS_REPORT_S = 5.0

# Serve's production timers that the suite's cluster changes, so that no test waits on them, and
# one that it lengthens, so that its many idle replicas cost less CPU (deploy/cluster.env and the
# shipped configs keep the production values):
SUITE_TIMERS = {
    # Every HAProxy-fronted replica that stops drains at least this long (Serve's default:
    # 30 s) so that a load balancer in front can deregister it. Serve's HAProxy retries a
    # refused connection, so a short drain cuts nothing here; the rollout test keeps the
    # production value in its own application (it proves no stream is cut while replaced).
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    "RAY_metrics_report_interval_ms": str(int(METRICS_REPORT_S * 1000)),
    # Serve's controller sets its health and status gauges again this often while they hold still
    # (Serve's default: 10 s, inside the 20 s for which Ray's agent keeps an unset gauge at the
    # default export interval). At the suite's 5 s interval the agent keeps one 10 s: the
    # dashboard test's "Replicas" panels and `$application` read no series now and then under
    # load. Half the interval: set again at least once within every export (each set of a gauge
    # per replica costs the controller CPU: at a fifth of the interval it took about a tenth of a
    # core more, in one run).
    "RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S": str(METRICS_REPORT_S / 2),
    # Each replica reports its ongoing requests to Serve's autoscaler this often (Serve's default:
    # 10 s); glm-autoscaled's look-back is 10 s (tests/e2e/harness/apps.py).
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
    # A node sent SIGTERM first drains for up to this long (Ray's default: 30 s), so that a pod's
    # Serve replicas leave before its processes go. The suite stops a node only after the Serve
    # applications on it are gone (the node-drain test drains its node with the pod's hook), and
    # a drain with nothing left to move still waited out the 30 s at the suite's stop.
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # Serve's controller runs its control loop this often (Serve's default: every 0.1 s). Tending
    # the suite's applications, the controller took about 16% of a core over a run at 0.1 s and
    # 10.5% at 0.5 s, on a 2-core machine; every wait the tests make is a condition, so a state
    # seen up to 0.5 s later only shifts when it is seen.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Ray's agent reads every process's CPU and memory with psutil and exports them as the node's
    # metrics this often (Ray's default: every 5 s): a fifth of the agent's CPU in a py-spy profile
    # of the suite's start, for ray_node_* and ray_component_* series that no test, panel or rule
    # reads (Serve's and vLLM's metrics are exported on their own interval, above).
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
}


def suite_cluster_env() -> dict[str, str]:
    """Serve's cluster settings as deploy/cluster.env ships them, with the suite's shorter timers."""
    return cluster_env() | SUITE_TIMERS


# Ray's workers listen on ports 10002-19999 (its default min/max_worker_port), and the kernel
# gives outgoing connections source ports from its ephemeral range (32768-60999 by default):
# a port the kernel handed out as free could be some connection's source port by the time a
# server binds it (in CI, Serve's gRPC proxy on the bare `serve run` cluster could not bind the
# port picked before its cluster's 40 s start). Ports between the two are given only to whoever
# binds them by number.
_handed_out: set[int] = set()
EVERY_ADDRESS = ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"))


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(family: socket.AddressFamily, address: str, port: int) -> bool:
    try:
        with socket.socket(family) as sock:
            sock.bind((address, port))
    except OSError as error:
        return error.errno != errno.EADDRINUSE  # no IPv6 here: that family does not count
    return True


def free_port() -> int:
    """A port nothing listens on, outside Ray's worker ports and the kernel's ephemeral range."""
    low, high = 20000, _ephemeral_ports_start() - 1
    for port in random.sample(range(low, high + 1), high - low + 1):
        # On every address, as servers bind ([::] for Serve's gRPC proxy).
        if port not in _handed_out and all(_bindable(family, host, port) for family, host in EVERY_ADDRESS):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


def stop_blocking_ray(process: subprocess.Popen | None) -> None:
    """Stop a ``ray start --block`` process, and with it exactly its node; kill its group if it lingers."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@dataclass
class RayCluster:
    """A one-node Ray cluster started with ``ray start --head --block``."""

    # Short: Ray's Unix sockets live below it, and their paths are limited to 107 bytes.
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="glm4-ray-", dir="/tmp")))
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    agent_port: int = field(default_factory=free_port)  # the dashboard agent's HTTP port (KubeRay probes it)
    # Serve's HAProxy mode takes fixed ports of its own (its metrics, its stats, the Python
    # proxy it falls back on): free ones, so that a `make serve` beside the suite still starts.
    serve_ports: dict[str, str] = field(
        default_factory=lambda: {
            name: str(free_port())
            for name in (
                "RAY_SERVE_HAPROXY_METRICS_PORT",
                "RAY_SERVE_HAPROXY_STATS_PORT",
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
                "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
            )
        }
    )
    # The environment Ray starts with: Serve's cluster settings as `make serve` has them (HAProxy on),
    # the suite's timers shortened; empty for Ray's own defaults, as under a bare `serve run`.
    settings: dict[str, str] = field(default_factory=suite_cluster_env)
    start_args: tuple[str, ...] = ()  # more of `ray start`'s options (e.g. --redis-password)
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def haproxy_stats_url(self) -> str:
        """HAProxy's stats page as CSV: each backend's servers and whether HAProxy holds them up."""
        return f"http://127.0.0.1:{self.serve_ports['RAY_SERVE_HAPROXY_STATS_PORT']}/stats;csv"

    @property
    def token_path(self) -> Path:
        return self.root / "auth_token"

    @property
    def env(self) -> dict[str, str]:
        """What a Ray client (driver, `serve` or `ray` CLI) needs to reach this cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path), "RAY_ADDRESS": self.address}

    def start(self) -> None:
        """Start the head; again after it stopped, as a restarted head pod does (the same token)."""
        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token,
        )

        if not self.token_path.exists():
            self.token_path.write_text(generate_new_authentication_token())
            self.token_path.chmod(0o600)
        # `ray start` writes the cluster's address there once the head is up.
        ready = self.root / "ray" / "ray_current_cluster"
        ready.unlink(missing_ok=True)
        ray_cli = Path(sys.executable).with_name("ray")
        log = (self.root / "ray-start.log").open("w")
        self.process = subprocess.Popen(
            [
                str(ray_cli),
                "start",
                "--head",
                "--block",
                "--disable-usage-stats",
                "--temp-dir",
                str(self.root / "ray"),
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                str(self.gcs_port),
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(self.dashboard_port),
                "--metrics-export-port",
                str(self.metrics_port),
                "--ray-client-server-port",
                str(free_port()),
                "--dashboard-agent-listen-port",
                str(self.agent_port),
                *self.start_args,
            ],
            # Its settings (as `make serve` starts Ray, timers shortened), on this cluster's own ports.
            env=os.environ | self.settings | self.serve_ports | self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        process = self.process

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"ray start failed:\n{(self.root / 'ray-start.log').read_text()[-3000:]}")
            return ready.exists()

        wait_until_blocking(up, START_TIMEOUT_S, "the suite's Ray head up", every_s=0.2)

    def start_as_a_pod(self, attempts: int = 2) -> None:
        """Start the head as a pod's container starts: a command that fails is run again (the kubelet's
        restart), up to ``attempts`` times. ``ray start`` gives the GCS 30 s (a constant in Ray) to answer
        for its node; in one CI run, unit tests beside it, a head restarted onto its Redis did not."""
        for attempt in range(1, attempts + 1):
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == attempts:
                    raise
                if self.process is not None:  # what the failed start left in its group (the GCS, the raylet)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.process.pid, signal.SIGKILL)

    def engine_failures(self, limit: int = 60) -> list[str]:
        """What the cluster's logs say of engines that failed: the replicas' engine watch (hung,
        died) and vLLM's engine processes' errors, ``limit`` lines at most. A traceback is cut to
        its headline and its exception (its frames would crowd the exception out of a CI log's
        excerpt). A CI run's failure prints them (its Ray directory is gone once the suite ends)."""
        found: dict[str, None] = {}
        logs = {
            p.resolve()
            for pattern in ("**/logs/serve/replica_*.log", "**/logs/worker-*")
            for p in self.root.glob(pattern)
        }
        for path in sorted(logs):
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if ENGINE_FAILURE.search(line) and not TRACEBACK_FRAME.search(line):
                        found.setdefault(f"{path.name[-16:]}: {line[:400]}")
        return list(found)[:limit]

    def stop(self) -> None:
        """Stop this cluster's head (and with it its raylet, GCS and workers), nothing else; remove its files,
        unless ``KEEP_TEST_RAY_DIR`` is set (to read a failed run's Ray and Serve logs afterwards)."""
        stop_blocking_ray(self.process)
        if os.environ.get("KEEP_TEST_RAY_DIR"):
            print(f"the suite's Ray directory is kept: {self.root}")
            return
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class RayNode:
    """A worker node joined to a :class:`RayCluster` with ``ray start --address ... --block``.

    Several can run on this machine next to the head: each gets its own free ports, no
    CPUs of its own (the head's serve the app), and the custom ``resources`` that place a
    test's actors on it. Stopping its one process stops exactly this node.
    """

    cluster: RayCluster
    name: str
    resources: dict[str, float]
    process: subprocess.Popen | None = None

    @property
    def temp_dir(self) -> Path:
        """This node's own Ray directory (sessions, logs), below the cluster's."""
        return self.cluster.root / f"node-{self.name}"

    def start(self) -> str:
        """Start the node; return its Ray node id once the cluster sees it alive."""
        import json

        import ray

        ray_cli = Path(sys.executable).with_name("ray")
        log = (self.cluster.root / f"node-{self.name}.log").open("w")
        self.process = subprocess.Popen(
            [
                str(ray_cli),
                "start",
                "--address",
                self.cluster.address,
                "--block",
                "--disable-usage-stats",
                "--temp-dir",
                str(self.temp_dir),
                "--node-ip-address",
                "127.0.0.1",
                "--num-cpus",
                "0",
                "--resources",
                json.dumps(self.resources),
                "--metrics-export-port",
                str(free_port()),
                "--dashboard-agent-listen-port",
                str(free_port()),
            ],
            env=os.environ | self.cluster.settings | self.cluster.serve_ports | self.cluster.env,  # as on the head
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        process = self.process

        def joined() -> str | None:
            if process.poll() is not None:
                raise RuntimeError(f"ray start failed:\n{Path(log.name).read_text()[-3000:]}")
            for node in ray.nodes():
                if node["Alive"] and self.resources.items() <= node["Resources"].items():
                    return node["NodeID"]
            return None

        return wait_until_blocking(joined, START_TIMEOUT_S, f"node {self.name} joined", every_s=0.2)

    def stop(self) -> None:
        """Stop this node (its raylet and workers), nothing else."""
        stop_blocking_ray(self.process)
