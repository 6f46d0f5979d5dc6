"""k8s/monitoring: the Grafana dashboard's queries name metrics the app exports, and the
PodMonitor scrapes every Ray pod of the RayService.

Names are checked against their sources: this app's from serve_app.observability.metrics,
vLLM's and Ray Serve's from the installed packages' code (Ray exports vLLM's ``vllm:x`` as
``ray_vllm_x``). tests/e2e/test_observability.py checks the same names against a real scrape.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import ray.serve
import vllm.v1.metrics.loggers
import yaml

from serve_app.observability.metrics import exported_names
from tests.unit.test_k8s import K8S, OVERLAYS, rendered

MONITORING = K8S / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
_METRIC = re.compile(r"\bray_[a-zA-Z0-9_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every metric name in the dashboard's panel queries and template variables."""
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {name for query in queries for name in _METRIC.findall(query)}


def base_name(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@functools.cache
def source_text(package_dir: Path) -> str:
    return "\n".join(path.read_text(errors="replace") for path in package_dir.rglob("*.py"))


def is_exported(name: str) -> bool:
    if name.startswith("ray_glm4_serve_"):
        return name in exported_names()
    if name.startswith("ray_vllm_"):
        vllm_name = "vllm:" + base_name(name).removeprefix("ray_vllm_")
        return f'"{vllm_name}"' in Path(vllm.v1.metrics.loggers.__file__).read_text()
    if name.startswith("ray_serve_"):
        return f'"{base_name(name).removeprefix("ray_")}"' in source_text(Path(ray.serve.__file__).parent)
    return False


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"])


def test_every_dashboard_query_names_a_metric_the_app_exports(dashboard):
    names = dashboard_metrics(dashboard)
    assert {n for n in names if n.startswith("ray_glm4_serve_")} == {
        n for n in exported_names() if not n.endswith(("_sum", "_count"))
    }, "every serving metric has a panel"
    assert any(n.startswith("ray_vllm_") for n in names) and any(n.startswith("ray_serve_") for n in names)
    assert [n for n in sorted(names) if not is_exported(n)] == []


def test_the_name_check_rejects_names_nobody_exports():
    assert not is_exported("ray_glm4_serve_time_to_first_token_seconds")  # a histogram has no bare sample
    assert not is_exported("ray_vllm_no_such_metric")
    assert not is_exported("ray_serve_no_such_metric_total")
    assert is_exported("ray_vllm_num_requests_running") and is_exported("ray_serve_deployment_replica_healthy")


def test_the_dashboard_and_pod_monitor_render_with_kustomize():
    from tests.unit.test_k8s import kubectl
    import subprocess

    out = subprocess.run([kubectl(), "kustomize", str(MONITORING)], check=True, capture_output=True, text=True).stdout
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}
    assert set(docs) == {"ConfigMap", "PodMonitor"}
    assert docs["ConfigMap"]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(docs["ConfigMap"]["data"]["grafana-dashboard.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_monitor_scrapes_every_ray_pod_on_its_metrics_port(overlay):
    monitor = yaml.safe_load((MONITORING / "pod-monitor.yaml").read_text())
    wanted = dict(monitor["spec"]["selector"]["matchLabels"])
    assert wanted.pop("ray.io/is-ray-node") == "yes"  # KubeRay's label on every Ray pod
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [service] = [doc for doc in rendered(overlay) if doc["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        assert wanted.items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == 8080  # Ray's metrics export port on KubeRay pods
