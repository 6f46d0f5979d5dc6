"""The Grafana dashboard and the alerting rules on a real Prometheus scraping the suite's apps.

Prometheus (Debian's package) scrapes Ray's metrics endpoint every 3 s while traffic
runs: complete streams and abandoned streams (aborts) on the bed, and a burst past the
small-queue variant's queue while its engine is paused (429s). Then the apps idle for longer than Ray keeps a
gauge that is not set again (20 s), and every panel query of k8s/monitoring/grafana-dashboard.json is evaluated as
Grafana would (``$model`` and ``$application`` as "All", ``$__rate_interval`` as 1m):
each must return a series, and the gauges must read 0.
The rules of k8s/monitoring/prometheus-rules.yaml are loaded into the same
Prometheus; each expression is evaluated, each rule must evaluate without error,
and promtool must accept the file.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import yaml

from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import QUEUES, TAKES
from tests.e2e.harness.bodies import LONG, chat
from tests.e2e.harness.prometheus import Prometheus
from tests.e2e.harness.ray_cluster import METRICS_REPORT_S
from tests.e2e.harness.simulation import Bed, ready_bed
from tests.e2e.harness.streams import open_streams
from tests.repo.k8s_manifests import DASHBOARD, MONITORING
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("direct")

RULES = MONITORING / "prometheus-rules.yaml"
GAUGE_TTL_S = 2 * METRICS_REPORT_S  # two of Ray's export intervals: an unset gauge is dropped after this
VARIABLES = {"$model": ".*", "$application": ".*", "$__rate_interval": "1m"}


def as_grafana_queries(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, query) for every panel target, and the template variables' metrics."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        (panel["title"], target.get("legendFormat", ""), as_grafana_queries(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(metric, label) is Grafana's, not PromQL
            metric, label = variable["query"].removeprefix("label_values(").removesuffix(")").split(", ")
            queries.append((f"variable ${variable['name']}", label, f"group by ({label}) ({metric})"))
    return queries


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["spec"]["groups"]


@pytest.fixture(scope="module")
def prometheus(metrics_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    rules = workdir / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))  # the PrometheusRule's spec, as a rule file
    server = Prometheus.start(metrics_url, workdir, [rules])
    yield server
    server.stop()


EXCESS = 16  # refused with 429 (overloaded) past what the small-queue variant runs and queues


async def drive_traffic(bed: Bed, small_queue: Bed) -> None:
    """Complete streams and abandoned streams (aborts) on the bed, and a burst past the small-queue
    variant's queue while its engine is paused: at least the excess is refused with 429 (within
    seconds of other traffic Serve's router may refuse some more while it dispatches, by its own
    account: ``wrap_request_assignment`` in ray/serve/_private/router.py)."""
    app = bed.app
    async with httpx.AsyncClient(base_url=app.url, timeout=300) as client:
        for _ in range(3):
            response = await client.post("/v1/chat/completions", json=chat(app.model, 16, stream=True))
            assert response.status_code == 200
        await bed.engines.control_all(Control.PACE, 10.0)  # they cannot end before their clients leave
        async with open_streams(client, chat(app.model, LONG, stream=True), 4):
            pass  # each stream has its first chunk; leaving aborts them
        await bed.engines.wait_until_idle()
        await bed.engines.control_all(Control.PACE, 1.0)
    await small_queue.engines.wait_until_idle()  # the burst below is sized for an empty replica
    limits = httpx.Limits(max_connections=TAKES + QUEUES + EXCESS)
    async with httpx.AsyncClient(base_url=small_queue.app.url, timeout=300, limits=limits) as client:
        async with small_queue.engines.paused():
            burst = [
                asyncio.create_task(client.post("/v1/chat/completions", json=chat(app.model, 8)))
                for _ in range(TAKES + QUEUES + EXCESS)
            ]
            await wait_until(lambda: sum(task.done() for task in burst) >= EXCESS, 120, f"{EXCESS} refusals")
        statuses = [response.status_code for response in await asyncio.gather(*burst)]
    assert set(statuses) == {200, 429} and statuses.count(429) >= EXCESS, set(statuses)


@pytest.fixture
async def small_queue(variants) -> Bed:
    """``direct``: the bed with a replica taking TAKES requests and queueing QUEUES (tests/e2e/harness/apps.py)."""
    return await ready_bed(variants["direct"])


def scraped(prometheus: Prometheus, expr: str) -> bool:
    return bool(prometheus.query(expr))


async def test_every_panel_and_rule_answers_on_a_real_prometheus_after_traffic_and_idle(bed, small_queue, prometheus):
    # A baseline first: rate() and increase() need a sample from before the traffic.
    await wait_until(
        lambda: prometheus.query("ray_glm4_serve_requests_total"),
        60,
        "Prometheus holds the app's (zeroed) counters before the traffic",
    )
    await drive_traffic(bed, small_queue)
    # Twice: a series appears at its first event, which rate() cannot see; the second
    # round's events land on series Prometheus already holds.
    await wait_until(
        lambda: scraped(prometheus, 'ray_glm4_serve_requests_total{status="200"}')
        and scraped(prometheus, 'ray_glm4_serve_requests_total{status="499"}')
        and scraped(prometheus, 'ray_glm4_serve_requests_total{status="429"} > 0'),
        60,
        "Prometheus holds the first round's series",
    )
    await drive_traffic(bed, small_queue)
    idle_since = time.time()
    # Idle longer than Ray keeps a gauge nobody sets again, as Prometheus saw it.
    await wait_until(
        lambda: prometheus.last_scrape_at() > idle_since + GAUGE_TTL_S + 5,
        GAUGE_TTL_S + 60,
        "Prometheus scrapes the idle app for longer than a gauge's lifetime",
    )
    # Every query below is evaluated as of one scrape that succeeded (a failed one hides every series)
    # and that found the gauges: on a loaded machine Ray's agent can miss an export of them, and a
    # scrape then finds none until the next (the counters stay). A later good scrape is taken then;
    # a gauge missing from every scrape for a minute fails.
    answers: dict[str, list] = {}

    def every_panel_answers() -> float | None:
        at = prometheus.last_good_scrape_at()
        if at is None:
            return None
        answers.clear()
        for title, legend, expr in panel_queries():
            answers[f"{title} [{legend}]"] = [(s["metric"], s["value"][1]) for s in prometheus.query(expr, at)]
        return at if all(answers.values()) else None

    try:
        at = await wait_until(
            every_panel_answers, 60, "a good scrape of the idle app in which every panel answers", every_s=1
        )
    finally:
        print("panel queries after idle:\n" + "\n".join(f"  {k}: {v}" for k, v in answers.items()))
        print("queries without a series (No data):", [name for name, series in answers.items() if not series])

    # Idle: the gauges read 0 (they are there, and not stuck at their last busy value).
    for expr in [
        "sum(ray_glm4_serve_requests_queued)",
        "sum(ray_glm4_serve_requests_running)",
        "sum(ray_vllm_num_requests_running)",
        "sum(ray_vllm_num_requests_waiting)",
        "max(ray_vllm_kv_cache_usage_perc)",
    ]:
        [series] = prometheus.query(expr, at)
        assert float(series["value"][1]) == 0, (expr, series)
    # Every healthy model replica's engine reports, also one that has not run a step (a replica
    # whose engine died may still report while Serve replaces it: at least, not exactly).
    [replicas] = prometheus.query('sum(ray_serve_deployment_replica_healthy{deployment=~"model-.*"})', at)
    [engines] = prometheus.query("count(ray_vllm_num_requests_running)", at)
    assert float(engines["value"][1]) >= float(replicas["value"][1]), (engines, replicas)
    # Events that did happen are there to see: aborts within the last minutes.
    [aborted] = prometheus.query("sum(increase(ray_glm4_serve_aborted_requests_total[2m]))", at)
    assert float(aborted["value"][1]) > 0

    values = {}
    for group in rule_groups():
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            values[name] = [(s["metric"], s["value"][1]) for s in prometheus.query(rule["expr"], at)]
            if "record" in rule:
                assert values[name], f"recording rule {name} has no series"
    print("rule expressions after idle:\n" + "\n".join(f"  {k}: {v}" for k, v in values.items()))
    # The burst's 429s show in the served model's ratio.
    ratios = {m["model"]: float(r) for m, r in values["glm4_serve:rejected_ratio:rate5m"]}
    assert ratios[bed.app.model] > 0, ratios
    loaded = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert len(loaded) == sum(len(g["rules"]) for g in rule_groups())
    assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []
    firing = {r["name"] for r in loaded if r["type"] == "alerting" and r["state"] == "firing"}
    assert "GLM4ServeNoHealthyModelReplica" not in firing and "GLM4ServeServerErrors" not in firing, firing
