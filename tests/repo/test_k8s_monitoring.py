"""k8s/monitoring: the dashboard is well-formed Grafana JSON, the kustomization renders,
and the PodMonitor scrapes every Ray pod of the RayService.

Whether every panel query and alerting rule answers is checked on a real Prometheus
scraping the real app: tests/e2e/test_dashboard.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from serve_app.front_door.telemetry.metrics import exported_names
from serve_app.routing.metrics import prefix_routing_names
from tests.repo.k8s_manifests import DASHBOARD, MONITORING, OVERLAYS, rendered

_METRIC = re.compile(r"\bray_[a-zA-Z0-9_]+")


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


def test_every_serving_metric_has_a_panel(dashboard):
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    shown = {name for name in _METRIC.findall(queries) if name.startswith("ray_glm4_serve_")}
    expected = exported_names() | prefix_routing_names()
    assert shown == {n for n in expected if not n.endswith(("_sum", "_count"))}


def test_the_dashboard_pod_monitor_and_rules_render_with_kustomize():
    import subprocess

    from tests.repo.k8s_manifests import kubectl

    out = subprocess.run([kubectl(), "kustomize", str(MONITORING)], check=True, capture_output=True, text=True).stdout
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}
    assert set(docs) == {"ConfigMap", "PodMonitor", "PrometheusRule"}
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


def test_promtool_accepts_the_rules(tmp_path):
    """Prometheus's own checker (Debian's prometheus package, `make servers`) reads every rule."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not installed: run tools/install-servers (make servers)"
    groups = yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())["spec"]["groups"]
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in check.stdout
