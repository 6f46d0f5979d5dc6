"""The Grafana dashboard and the alerting rules on a real Prometheus scraping the real app.

Prometheus (Debian's package) scrapes Ray's metrics endpoint every second while
traffic runs: complete streams, a burst past the queue (429s) and abandoned
streams (aborts). Then the app idles for longer than Ray keeps a gauge that is
not set again (20 s), and every panel query of k8s/monitoring/grafana-dashboard.json
is evaluated as Grafana would (``$model`` and ``$application`` as "All",
``$__rate_interval`` as 1m): each must return a series, and the gauges must read 0.
The rules of k8s/monitoring/prometheus-rules.yaml are loaded into the same
Prometheus; each expression is evaluated, each rule must evaluate without error,
and promtool must accept the file.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.prometheus import Prometheus, prometheus_binary
from tests.e2e.serve_state import replica_states
from tests.e2e.telemetry import wait_until
from tests.e2e.test_load import (
    BURST,
    BURST_TOKENS,
    LONG,
    chat,
    in_flight_reaches_zero,
    open_streams,
)
from tests.unit.test_k8s_monitoring import DASHBOARD, MONITORING

RULES = MONITORING / "prometheus-rules.yaml"
GAUGE_TTL_S = 20  # two of Ray's 10 s metric export intervals: an unset gauge is dropped after this
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


def test_promtool_accepts_the_rules(tmp_path: Path):
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))
    check = subprocess.run(
        [prometheus_binary("promtool"), "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in check.stdout


MAX_BURSTS = 3  # a burst the queue drains while it arrives (a busy box) is sent again
# Shorter answers than test_load's burst: here the deployment may admit twice as many (two ingress routers).


async def admitted_at_most(app, deployment) -> int:
    """How many requests the model deployment takes in before it answers 429.

    Each model replica runs ``max_ongoing_requests``; each ingress replica's router
    queues ``max_queued_requests`` more (Serve's limit is per caller), and earlier
    tests may have scaled either deployment out.
    """
    options = yaml.safe_load(app.config_path.read_text())["applications"][0]["args"]["models"][0]["deployment"]
    running = {
        name: max(
            1,
            (await replica_states(SimpleNamespace(app_name=deployment.app_name, deployment_name=name))).get(
                "RUNNING", 1
            ),
        )
        for name in (deployment.deployment_name, "Ingress")
    }
    return (
        running[deployment.deployment_name] * options["max_ongoing_requests"]
        + running["Ingress"] * options["max_queued_requests"]
    )


async def drive_traffic(app, deployment) -> dict[int, int]:
    """Complete streams, bursts past the queue until one gets 429s, abandoned streams; the bursts' statuses."""
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=app.url, timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        await in_flight_reaches_zero(deployment, within_s=30.0)
        for _ in range(3):
            response = await client.post("/v1/chat/completions", json=chat(app.model, stream=True, max_tokens=16))
            assert response.status_code == 200
        for _ in range(MAX_BURSTS):
            size = max(BURST, 3 * await admitted_at_most(app, deployment) // 2)
            burst = await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json=chat(app.model, max_tokens=BURST_TOKENS // 2, min_tokens=BURST_TOKENS // 2),
                    )
                    for _ in range(size)
                )
            )
            for response in burst:
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if 429 in statuses:
                break
        async with open_streams(client, chat(app.model, stream=True, **LONG), 4):
            pass  # each stream has its first chunk; leaving aborts them
        await in_flight_reaches_zero(deployment, within_s=30.0)
    return statuses


# The burst may scale the model deployment out. First among the disruptive tests: right after
# the scale-out test, three bursts of 480 (1.5x what one replica and one ingress router admit)
# got no 429 in CI, where the same burst after the fault tests does; not understood yet.
@pytest.mark.disruptive(first=True)
async def test_every_panel_and_rule_answers_on_a_real_prometheus_after_traffic_and_idle(app, one_replica, prometheus):
    statuses = await drive_traffic(app, one_replica)
    # 429 past the queue; an admitted answer may still pass the CPU config's 60 s limit (504).
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429, 504}, statuses
    idle_since = time.time()
    # Idle longer than Ray keeps a gauge nobody sets again, as Prometheus saw it.
    wait_until(
        lambda: prometheus.last_scrape_at() > idle_since + GAUGE_TTL_S + 5,
        within_s=GAUGE_TTL_S + 60,
        what="Prometheus scrapes the idle app for longer than a gauge's lifetime",
    )

    answers = {}
    for title, legend, expr in panel_queries():
        answers[f"{title} [{legend}]"] = [(s["metric"], s["value"][1]) for s in prometheus.query(expr)]
    print("panel queries after idle:\n" + "\n".join(f"  {k}: {v}" for k, v in answers.items()))
    assert [name for name, series in answers.items() if not series] == [], "queries without a series (No data)"

    # Idle: the gauges read 0 (they are there, and not stuck at their last busy value).
    for expr in [
        "sum(ray_glm4_serve_requests_queued)",
        "sum(ray_glm4_serve_requests_running)",
        "sum(ray_vllm_num_requests_running)",
        "sum(ray_vllm_num_requests_waiting)",
        "max(ray_vllm_kv_cache_usage_perc)",
    ]:
        [series] = prometheus.query(expr)
        assert float(series["value"][1]) == 0, (expr, series)
    # Every model replica's engine reports, also one that has not run a step.
    [replicas] = prometheus.query('sum(ray_serve_deployment_replica_healthy{deployment=~"model-.*"})')
    [engines] = prometheus.query("count(ray_vllm_num_requests_running)")
    assert engines["value"][1] == replicas["value"][1], (engines, replicas)
    # Events that did happen are there to see: 429s and aborts within the last minutes.
    [rejected] = prometheus.query('sum(increase(ray_glm4_serve_rejected_requests_total{reason="overloaded"}[2m]))')
    assert float(rejected["value"][1]) > 0
    [aborted] = prometheus.query("sum(increase(ray_glm4_serve_aborted_requests_total[2m]))")
    assert float(aborted["value"][1]) > 0

    values = {}
    for group in rule_groups():
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            values[name] = [(s["metric"], s["value"][1]) for s in prometheus.query(rule["expr"])]
            if "record" in rule:
                assert values[name], f"recording rule {name} has no series"
    print("rule expressions after idle:\n" + "\n".join(f"  {k}: {v}" for k, v in values.items()))
    [(_, rejected_ratio)] = values["glm4_serve:rejected_ratio:rate5m"]
    assert float(rejected_ratio) > 0  # the burst's 429s, though they came all at once
    loaded = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert len(loaded) == sum(len(g["rules"]) for g in rule_groups())
    assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []
    firing = {r["name"] for r in loaded if r["type"] == "alerting" and r["state"] == "firing"}
    assert "GLM4ServeNoHealthyModelReplica" not in firing and "GLM4ServeServerErrors" not in firing, firing
