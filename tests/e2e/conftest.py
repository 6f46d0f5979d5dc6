"""Start the real application once per test session and share it.

The app is started as `make serve` starts it: a Ray head with token
authentication, then ``serve run`` on the embedded default config
``deploy/config.cpu.yaml`` (the real vLLM CPU engine on the tiny GLM-4 model).
The head is the suite's own (:mod:`tests.e2e.ray_cluster`: its temp dir, token
and ports), the HTTP and gRPC ports are free ones, and the standard OpenTelemetry
variables are set in the app's ``runtime_env`` so its replicas export traces to
the tests' collector: nothing collides with, or changes, what a developer runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.ray_cluster import RayCluster, free_port
from tests.e2e.telemetry import OTLPCollector

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "config.cpu.yaml"
START_TIMEOUT_S = 420


@dataclass(frozen=True)
class RunningApp:
    url: str
    grpc_target: str  # host:port of Serve's gRPC proxy
    model: str
    model_path: Path  # the engine's checkpoint, for tests that need its tokenizer
    log_path: Path
    config_path: Path  # the config `serve run` was given

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)
    # Tests that change the shared app (replica counts, its config) run last.
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)


def wait_until_healthy(url: str, proc: subprocess.Popen, app: RunningApp) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve run exited with {proc.returncode} before the app was healthy:\n{app.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)  # poll interval of the condition above
    pytest.fail(f"app not healthy after {START_TIMEOUT_S}s:\n{app.log_tail()}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # serve run shuts the app down
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="session")
def otlp_collector():
    collector = OTLPCollector()
    yield collector
    collector.close()


USER_TOKEN = Path.home() / ".ray" / "auth_token"


def token_file_state(path: Path = USER_TOKEN) -> tuple[bytes, int] | None:
    """The user's Ray token file as it is (content, mtime), or None when there is none."""
    return (path.read_bytes(), path.stat().st_mtime_ns) if path.exists() else None


USER_TOKEN_AT_START = token_file_state()  # read when pytest imports this file, before any cluster starts


@pytest.fixture(scope="session")
def ray_cluster():
    """The suite's own Ray head; this process and every Ray command the tests run use its token."""
    cluster = RayCluster()
    saved = {name: os.environ.get(name) for name in cluster.env}
    os.environ.update(cluster.env)
    reload_ray_auth_settings()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_ray_auth_settings()


def reload_ray_auth_settings() -> None:
    """Make this process read RAY_AUTH_* again: Ray caches its config (and the token) on first use,
    which collecting the unit tests may already have caused."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture(scope="session")
def app(tmp_path_factory, otlp_collector, ray_cluster) -> Iterator[RunningApp]:
    config = yaml.safe_load(CONFIG.read_text())
    port, grpc_port = free_port(), free_port()
    config["http_options"]["port"] = port
    config["grpc_options"]["port"] = grpc_port
    env_vars = config["applications"][0].setdefault("runtime_env", {}).setdefault("env_vars", {})
    env_vars["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = otlp_collector.endpoint
    env_vars["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # what the collector speaks
    env_vars["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # ms between span batches (default 5 s)
    # Only requests whose client sends a sampled traceparent are traced: the rest of the
    # suite's load adds no spans.
    env_vars["OTEL_TRACES_SAMPLER"] = "parentbased_always_off"
    workdir = tmp_path_factory.mktemp("serve")
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    model = config["applications"][0]["args"]["models"][0]
    running = RunningApp(
        url=f"http://127.0.0.1:{port}",
        grpc_target=f"127.0.0.1:{grpc_port}",
        model=model["name"],
        model_path=REPO / model["engine_args"]["model"],
        log_path=workdir / "serve.log",
        config_path=config_path,
    )
    serve_cli = Path(sys.executable).with_name("serve")
    with running.log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(serve_cli), "run", "--address", ray_cluster.address, str(config_path)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until_healthy(running.url, proc, running)
        yield running
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def cluster(app, ray_cluster):
    """This process joined to the app's Ray cluster; yields the cluster's dashboard URL."""
    import ray

    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    yield ray_cluster.dashboard_url
    ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(cluster) -> str:
    """Ray's Prometheus endpoint on the app's (one-node) cluster."""
    import ray

    [node] = [n for n in ray.nodes() if n["Alive"]]
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


@pytest.fixture(scope="session")
def model_deployment(app, cluster):
    """A Ray Serve handle to the model deployment.

    Tests use it to read the engine's in-flight request count (``in_flight``), the
    same way an operator would, instead of guessing from timings.
    """
    from ray import serve

    config = yaml.safe_load(CONFIG.read_text())["applications"][0]
    model = config["args"]["models"][0]["name"]
    handle = serve.get_deployment_handle(f"model-{model}", app_name=config["name"])
    yield handle
    handle.shutdown()  # stop its router's background tasks before leaving the cluster


@pytest.fixture
async def one_replica(model_deployment):
    """The model deployment's handle, once the deployment is at exactly one running replica.

    Earlier tests may have scaled it out. A handle call reaches one replica, so a
    count read through it is the whole deployment's only when there is one.
    """
    from tests.e2e.serve_state import single_replica

    await single_replica(model_deployment)
    return model_deployment
