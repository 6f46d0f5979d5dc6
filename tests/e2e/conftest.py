"""Start the suite's applications once per test session and share them.

They are started as `make serve` starts an app: a Ray head with token authentication
and Serve's cluster settings (deploy/cluster.env), then ``serve run`` on a config of two
applications from deploy/ (:mod:`tests.e2e.harness.apps`): the CPU app (``app``: the real vLLM
CPU engine on the tiny GLM-4 model) and the bed (``sim_app``, and per test ``bed``: the
production shape on the simulated engine, driven through its controls). The head is the
suite's own (:mod:`tests.e2e.harness.ray_cluster`: its temp dir, token and ports), the HTTP and
gRPC ports are free ones, and the standard OpenTelemetry variables are set in the apps'
``runtime_env`` so their replicas export traces to the tests' collector: nothing collides
with, or changes, what a developer runs.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness.apps import BED_NAME, REPO, RETIRABLE, STARTED_LATER, RunningApp, suite_config
from tests.e2e.harness.ray_cluster import RayCluster, free_port, suite_cluster_env
from tests.e2e.harness.serve_run import all_healthy, start_serve_run, stop, wait_until_healthy
from tests.e2e.harness.serve_state import DeploymentName, serve_deploy_blocking, serve_retire, single_replica
from tests.e2e.harness.simulation import Bed, ready_bed
from tests.e2e.harness.telemetry import OTLPCollector
from tests.waiting import wait_until, wait_until_blocking
from tools.local_redis import LocalRedis

# A backstop over the suite's start: measured 4 to over 7 minutes on the 2-core CI machine (a fresh
# clone starts its CPU engines with a cold compile cache).
START_TIMEOUT_S = 900


# The modules on the bed's variants and the 4-bit app run first, in this order (each application's
# users together), so that each application is removed as early as it can be (see
# ``retire_applications_no_later_test_uses``): an idle application's replicas and picker, and its
# share of Serve's controller and Ray's metrics agent, cost the suite's 2 cores for as long as it
# runs (docs/testing.md, "Where the time goes").
FIRST_MODULES = (
    "test_direct_streaming",
    "test_dashboard",
    "test_prefix_routing",
    "test_simulated_engine",
    "test_faults",
    "test_stored_responses",
    "test_tenant_cache",
    "test_fair_share",
    "test_answers_as_work",
    "test_picker_keys",
    "test_rollout",
    "test_quantised_serving",
)


def run_order(item: pytest.Item) -> tuple[bool, bool, bool, int]:
    """Those that need the machine to themselves (alone) after the others, those that replace the
    CPU app's replica or drain a node (disruptive) after them, and one that leaves an app without a
    working replica (last) at the very end; before them, FIRST_MODULES first. (The unit tests are
    another pytest run: `make test`.)"""
    module = Path(str(item.fspath)).stem
    first = FIRST_MODULES.index(module) if module in FIRST_MODULES else len(FIRST_MODULES)
    return (
        item.get_closest_marker("last") is not None,
        item.get_closest_marker("disruptive") is not None,
        item.get_closest_marker("alone") is not None,
        first,
    )


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=run_order)  # (stable: each module's tests in their own order)


def applications_used(item: pytest.Item) -> set[str]:
    """The suite's retirable applications a test uses (its module's ``applications`` marker)."""
    marker = item.get_closest_marker("applications")
    return set(marker.args) if marker else set()


_NEXT_ITEM: list[pytest.Item | None] = [None]  # the test to run after the one being torn down


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _NEXT_ITEM[0] = nextitem  # before the fixtures this test's end tears down


@pytest.fixture(scope="module", autouse=True)
async def retire_applications_no_later_test_uses(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """After each run of a module's tests on the suite's applications: the bed's variants and the 4-bit
    app that no test still to run uses (their ``applications`` markers) are removed (``serve_retire``).
    A test that uses one without saying so finds it gone: a failure, never a silent pass. (A module's
    disruptive tests run at the end, apart from the rest: "still to run" is from the next test on.)

    Before them, the applications this run of the module's tests names answer (those started after
    the suite's first, :data:`~tests.e2e.harness.apps.STARTED_LATER`, may still be starting): a
    module whose last tests run apart (``disruptive``, ``last``) may name one retired by then."""
    items = request.session.items
    starting = _NEXT_ITEM[0] or items[0]  # the test now starting: the first of this run of the module's
    following_on = items[items.index(starting) :]
    module_items = list(itertools.takewhile(lambda item: getattr(item, "module", None) is request.module, following_on))
    if not any("serving" in getattr(item, "fixturenames", ()) for item in module_items):
        yield
        return  # the suite's applications are not running
    serving, dashboard_url = request.getfixturevalue("serving"), request.getfixturevalue("cluster")
    used = set().union(*(applications_used(item) for item in module_items))
    await wait_until(lambda: all_healthy([serving[name].url for name in used]), START_TIMEOUT_S, f"{sorted(used)} up")
    yield
    following = _NEXT_ITEM[0]
    later = items[items.index(following) :] if following is not None else []
    needed = set().union(*(applications_used(item) for item in later))
    suite_config = serving[BED_NAME].config_path
    running = {app["name"] for app in yaml.safe_load(suite_config.read_text())["applications"]}
    retired = (RETIRABLE & running) - needed
    if retired:
        await serve_retire(retired, suite_config, dashboard_url)


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


# What the suite's Ray logs said of engines that failed, read before its Ray directory goes when a
# test failed; the run's summary prints it (a fixture's own output shows only with a failing test's).
ENGINE_FAILURES: list[str] = []


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest):
    """The suite's own Ray head; this process and every Ray command the tests run use its token.
    When a test failed, what its logs say of engines that failed is kept for the run's summary."""
    cluster = RayCluster()
    saved = {name: os.environ.get(name) for name in cluster.env}
    os.environ.update(cluster.env)
    reload_ray_auth_settings()
    try:
        cluster.start()
        yield cluster
    finally:
        if request.session.testsfailed:
            ENGINE_FAILURES[:] = cluster.engine_failures() or ["none"]
        cluster.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_ray_auth_settings()


def pytest_terminal_summary(terminalreporter) -> None:
    if ENGINE_FAILURES:
        terminalreporter.section("engine failures in the suite's Ray logs")
        for line in ENGINE_FAILURES:
            terminalreporter.write_line(line)


def reload_ray_auth_settings() -> None:
    """Make this process read RAY_AUTH_* again: Ray caches its config (and the token) on first use,
    which collecting the unit tests may already have caused."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# Under `make --jobs test` (CI) the unit tests (and the end-to-end tests on clusters of their own,
# marked ``own_cluster``) start once the modules that keep both cores busy have run, and run beside
# the rest, which wait on timers more; tests marked ``alone`` run after the others and wait for the
# unit tests' end (the Makefile names the files each run makes: docs/testing.md).
UNIT_START, AFTER_UNIT_TESTS = "E2E_UNIT_START", "E2E_AFTER_UNIT_TESTS"
UNIT_TESTS_BOUND_S = 900
# The first modules: 94-99% of both cores beside the unit tests; the rest, alone, 42-80% (docs/testing.md).
BUSY_MODULES = FIRST_MODULES[:6]


def let_the_unit_tests_start() -> None:
    if path := os.environ.get(UNIT_START):
        Path(path).touch()


@pytest.fixture(scope="module", autouse=True)
def unit_tests_beside_the_quieter_modules(request: pytest.FixtureRequest) -> None:
    """The first module past the busy ones lets the unit tests start."""
    if request.module.__name__.rsplit(".", 1)[-1] not in BUSY_MODULES:
        let_the_unit_tests_start()


@pytest.fixture(autouse=True)
def alone_on_the_machine(request: pytest.FixtureRequest) -> None:
    """A test marked ``alone`` (its load needs both cores) starts once the unit tests have ended."""
    path = os.environ.get(AFTER_UNIT_TESTS)
    if path and request.node.get_closest_marker("alone") is not None:
        started = time.monotonic()
        wait_until_blocking(Path(path).exists, UNIT_TESTS_BOUND_S, f"the unit tests' end ({path})", every_s=1)
        print(f"waited {time.monotonic() - started:.0f} s for the unit tests' end")


@pytest.fixture(scope="session")
def responses_redis(tmp_path_factory) -> Iterator[LocalRedis]:
    """The Redis of the bed's stored responses (deploy/config.sim.yaml's ``ingress.responses_store``):
    Debian's redis-server, with a password."""
    redis = LocalRedis(tmp_path_factory.mktemp("responses-redis")).start()
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture(scope="session")
def serving(tmp_path_factory, otlp_collector, ray_cluster, responses_redis) -> Iterator[dict[str, RunningApp]]:
    """The suite's serve config run as `make serve` runs one: the CPU app, the bed and the bed's
    variants, each by its application name (tests/e2e/harness/apps.py)."""
    port, grpc_port = free_port(), free_port()
    workdir = tmp_path_factory.mktemp("serve")
    config = suite_config(
        port,
        grpc_port,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_collector.endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # what the collector speaks
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms between span batches (default 5 s)
            # Only requests whose client sends a sampled traceparent are traced: the rest of
            # the suite's load adds no spans.
            "OTEL_TRACES_SAMPLER": "parentbased_always_off",
        }
        | responses_redis.env(),
        workdir,
    )
    config_path = workdir / "config.yaml"
    first = config | {"applications": [a for a in config["applications"] if a["name"] not in STARTED_LATER]}
    config_path.write_text(yaml.safe_dump(first, sort_keys=False))
    log_path = workdir / "serve.log"

    def running_app(application: dict) -> RunningApp:
        model = application["args"]["models"][0]
        return RunningApp(
            name=application["name"],
            origin=f"http://127.0.0.1:{port}",
            route_prefix=application["route_prefix"],
            grpc_target=f"127.0.0.1:{grpc_port}",
            model=model["name"],
            model_path=REPO / model["engine_args"]["model"],
            log_path=log_path,
            config_path=config_path,
        )

    apps = {application["name"]: running_app(application) for application in config["applications"]}
    # As `make serve` runs it: Serve's cluster settings (the suite's timers) and the cluster's ports.
    proc = start_serve_run(
        ray_cluster.address, config_path, log_path, os.environ | suite_cluster_env() | ray_cluster.serve_ports
    )
    try:
        try:
            wait_until_healthy([apps[a["name"]].url for a in first["applications"]], proc, log_path, START_TIMEOUT_S)
        except BaseException:
            let_the_unit_tests_start()  # (no module will: they need not wait)
            raise
        # The rest start while the first tests run; the modules that use them wait for them.
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        serve_deploy_blocking(config_path, ray_cluster.dashboard_url)
        yield apps
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def app(serving) -> RunningApp:
    """The CPU app: deploy/config.cpu.yaml, the real vLLM engine on the tiny GLM-4 model."""
    return serving["glm"]


@pytest.fixture(scope="session")
def sim_app(serving) -> RunningApp:
    """The bed: deploy/config.sim.yaml's application on the simulated engine, under /sim."""
    return serving[BED_NAME]


@pytest.fixture(scope="session")
def cluster(serving, ray_cluster):
    """This process joined to the apps' Ray cluster; yields the cluster's dashboard URL."""
    import ray

    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    yield ray_cluster.dashboard_url
    ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(cluster) -> str:
    """Ray's Prometheus endpoint on the apps' (one-node) cluster."""
    import ray

    [node] = [n for n in ray.nodes() if n["Alive"]]  # the head (extra nodes join later, in one test)
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


@pytest.fixture(scope="session")
def model_deployment(app, cluster) -> DeploymentName:
    """The CPU app's model deployment (tests read its engines' in-flight count replica by replica)."""
    return DeploymentName(app.name, app.model_deployment)


@pytest.fixture
async def one_replica(model_deployment) -> DeploymentName:
    """The CPU app's model deployment, once it is at exactly one running replica with a live engine."""
    await single_replica(model_deployment)
    return model_deployment


@pytest.fixture
async def bed(sim_app, cluster) -> Bed:
    """The bed as every test finds it: one model replica, running at the timing model's pace, holding nothing."""
    return await ready_bed(sim_app)


@pytest.fixture(scope="session")
def variants(serving, cluster) -> dict[str, RunningApp]:
    """The bed's variants (tests/e2e/harness/apps.py, :func:`~tests.e2e.harness.apps.variant_applications`), by name."""
    return serving
