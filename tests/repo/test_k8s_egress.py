"""Where the Ray pods may connect: each other, the cluster's DNS, the Kubernetes API from the head,
Redis from the head and the responses store from the GPU workers (production); nowhere else, the
internet included (k8s/base/network-policy.yaml).

Read by Kubernetes' rules for egress policies: a pod that some Egress policy selects may open a
connection only where a rule of one of those policies admits the peer and the port.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.repo.k8s_manifests import DOCUMENT_SETS, documents, pod_templates, rayservices
from tests.repo.network_policies import APP_NAMESPACE, OUTSIDE, Peer, rule_admits, selects

RAY = {"app.kubernetes.io/part-of": "glm4-serve", "ray.io/cluster": "glm4-serve-x7k2p"}
HEAD, WORKER = RAY | {"ray.io/node-type": "head"}, RAY | {"ray.io/node-type": "worker"}
CLEANUP = RAY | {"ray.io/node-type": "redis-cleanup"}  # KubeRay's Job that deletes the GCS's state
DNS = Peer("kube-system", {"k8s-app": "kube-dns"})
REDIS = Peer(APP_NAMESPACE, {"app.kubernetes.io/name": "glm4-serve-redis"})
# The Responses API's store (production): the model replicas, on the GPU workers, keep responses there.
GPU_WORKER, CPU_WORKER = WORKER | {"ray.io/group": "gpu"}, WORKER | {"ray.io/group": "cpu"}
RESPONSES_STORE = Peer(APP_NAMESPACE, {"app.kubernetes.io/name": "glm4-serve-responses-store"})


def allowed(policies: list[dict[str, Any]], source: Peer, peer: Peer, port: int, protocol: str = "TCP") -> bool:
    """Whether ``source`` may connect to ``peer`` on ``port``: unselected by every Egress policy, or
    admitted by a rule of one that selects it."""
    selecting = [
        p
        for p in policies
        if "Egress" in p["spec"]["policyTypes"]
        and p["metadata"].get("namespace", APP_NAMESPACE) == source.namespace
        and selects(p["spec"]["podSelector"], source.labels)
    ]
    return not selecting or any(
        rule_admits(rule, "to", peer, port, protocol, source.namespace)
        for p in selecting
        for rule in p["spec"].get("egress", [])
    )


def test_the_reader_follows_kubernetes_rules():
    """Unselected pods go anywhere; a selected pod only where a rule admits; no `to` admits any peer."""
    policies = [
        {
            "metadata": {"namespace": "a"},
            "spec": {
                "podSelector": {"matchLabels": {"x": "1"}},
                "policyTypes": ["Egress"],
                "egress": [
                    {"ports": [{"port": 443}]},
                    {"to": [{"podSelector": {}}], "ports": [{"port": 53, "protocol": "UDP"}]},
                ],
            },
        }
    ]
    assert allowed(policies, Peer("a", {"y": "1"}), OUTSIDE, 80)
    assert allowed(policies, Peer("a", {"x": "1"}), OUTSIDE, 443) and not allowed(
        policies, Peer("a", {"x": "1"}), OUTSIDE, 80
    )
    assert allowed(policies, Peer("a", {"x": "1"}), Peer("a"), 53, "UDP")
    assert not allowed(policies, Peer("a", {"x": "1"}), Peer("a"), 53) and not allowed(
        policies, Peer("a", {"x": "1"}), Peer("b"), 53, "UDP"
    )


# (from, to, port, protocol, allowed without Redis, allowed with it: the production overlay and those on it)
REACHABILITY = [
    *[
        (pod, Peer(APP_NAMESPACE, other), port, "TCP", True, True)
        for pod in (HEAD, WORKER)
        for other in (HEAD, WORKER)
        for port in (6379, 8000, 43521)
    ],
    *[(pod, DNS, 53, protocol, True, True) for pod in (HEAD, WORKER, CLEANUP) for protocol in ("UDP", "TCP")],
    (HEAD, OUTSIDE, 443, "TCP", True, True),  # the Kubernetes API, for the autoscaler
    (HEAD, OUTSIDE, 6443, "TCP", True, True),
    *[(WORKER, OUTSIDE, port, "TCP", False, False) for port in (443, 6443, 80)],
    (HEAD, OUTSIDE, 80, "TCP", False, False),
    *[(pod, REDIS, port, "TCP", False, True) for pod in (HEAD, CLEANUP) for port in (6379, 26379)],
    *[(WORKER, REDIS, port, "TCP", False, False) for port in (6379, 26379)],
    (HEAD, REDIS, 80, "TCP", False, False),
    *[(GPU_WORKER, RESPONSES_STORE, port, "TCP", False, True) for port in (6379, 26379)],
    *[(pod, RESPONSES_STORE, port, "TCP", False, False) for pod in (HEAD, CPU_WORKER) for port in (6379, 26379)],
    (GPU_WORKER, RESPONSES_STORE, 80, "TCP", False, False),
    *[(pod, Peer("elsewhere", WORKER), 8000, "TCP", False, False) for pod in (HEAD, WORKER)],
    (WORKER, Peer("kube-system", {"k8s-app": "kube-dns"}), 8080, "TCP", False, False),
]


def case_id(case: tuple) -> str:
    source, peer, port, protocol, *_ = case
    who = {
        id(HEAD): "head",
        id(WORKER): "worker",
        id(CLEANUP): "cleanup",
        id(GPU_WORKER): "gpu",
        id(CPU_WORKER): "cpu",
    }[id(source)]
    to = (
        "outside"
        if peer == OUTSIDE
        else peer.labels.get("app.kubernetes.io/name")
        or peer.labels.get("k8s-app")
        or peer.labels.get("ray.io/node-type")
    )
    return f"{who}->{to}@{peer.namespace or '-'}:{port}/{protocol}"


@pytest.mark.parametrize("name", DOCUMENT_SETS)
@pytest.mark.parametrize(
    ("source", "peer", "port", "protocol", "without_redis", "with_redis"),
    REACHABILITY,
    ids=[case_id(c) for c in REACHABILITY],
)
def test_each_ray_pod_reaches_what_it_needs_and_nothing_else(
    name, source, peer, port, protocol, without_redis, with_redis
):
    policies = [d for d in documents(name) if d["kind"] == "NetworkPolicy"]
    redis = any(d["metadata"]["name"] == "glm4-serve-redis" for d in documents(name) if d["kind"] == "StatefulSet")
    expected = with_redis if redis else without_redis
    assert allowed(policies, Peer(APP_NAMESPACE, source), peer, port, protocol) is expected


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_every_ray_pod_template_is_under_the_egress_policy(name):
    """The policy selects each pod KubeRay makes from the templates (their labels plus KubeRay's)."""
    (policy,) = [
        d for d in documents(name) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "glm4-serve-egress"
    ]
    (rayservice,) = rayservices(name)
    for template in pod_templates(rayservice):
        labels = template["metadata"].get("labels", {}) | {"ray.io/cluster": "glm4-serve-x7k2p"}
        assert selects(policy["spec"]["podSelector"], labels), labels


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_no_ray_container_reports_usage(name):
    """Ray's and vLLM's usage reports are off: they would find no way out, and have nothing to tell."""
    (rayservice,) = rayservices(name)
    for template in pod_templates(rayservice):
        for container in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert (env["RAY_USAGE_STATS_ENABLED"], env["VLLM_NO_USAGE_STATS"]) == ("0", "1"), container["name"]
