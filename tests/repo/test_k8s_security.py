"""Cluster security in the manifests: Ray's token authentication, who may reach which port, API tokens.

Nothing here needs a cluster. The NetworkPolicy is read by Kubernetes' rules for ingress
policies: a connection to a selected pod is allowed when some rule admits both its peer
(namespace and pod labels) and its port. The suite's own Ray cluster runs with token
authentication (tests/e2e/harness/ray_cluster.py), so the app itself is proven to work with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.repo.k8s_manifests import DOCUMENT_SETS, ROOT, documents, pod_templates, rayservices, worker_groups
from tests.repo.network_policies import APP_NAMESPACE, Peer, rule_admits, selects

TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def admits(policy: dict[str, Any], peer: Peer, port: int) -> bool:
    """Whether an ingress NetworkPolicy lets ``peer`` connect to ``port`` (TCP) of the pods it selects."""
    namespace = policy["metadata"].get("namespace", APP_NAMESPACE)
    return any(rule_admits(rule, "from", peer, port, "TCP", namespace) for rule in policy["spec"].get("ingress", []))


def admitted(policies: list[dict[str, Any]], target: dict[str, str], peer: Peer, port: int) -> bool:
    """Whether ``peer`` may connect to ``port`` of a pod of this namespace labelled ``target``: open
    when no Ingress policy selects the pod, else when a rule of one that does admits it."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"]["policyTypes"]
        and p["metadata"].get("namespace", APP_NAMESPACE) == APP_NAMESPACE
        and selects(p["spec"]["podSelector"], target)
    ]
    return not selecting or any(admits(p, peer, port) for p in selecting)


def network_policy(name: str, policy_name: str = "glm4-serve") -> dict[str, Any]:
    (policy,) = [d for d in documents(name) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == policy_name]
    assert "Ingress" in policy["spec"]["policyTypes"]
    return policy


def test_the_policy_reader_follows_kubernetes_rules():
    """An empty peer list admits everyone; a rule with both selectors needs both; no rule, no entry."""
    policy = {
        "metadata": {"namespace": "a"},
        "spec": {
            "ingress": [
                {"ports": [{"port": 1}]},
                {"from": [{"podSelector": {"matchLabels": {"x": "1"}}}], "ports": [{"port": 2}]},
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}},
                            "podSelector": {"matchExpressions": [{"key": "y", "operator": "Exists"}]},
                        }
                    ],
                    "ports": [{"port": 3}],
                },
            ]
        },
    }
    assert admits(policy, Peer("z"), 1)
    assert admits(policy, Peer("a", {"x": "1"}), 2) and not admits(policy, Peer("b", {"x": "1"}), 2)
    assert admits(policy, Peer("b", {"y": ""}), 3) and not admits(policy, Peer("b"), 3)
    assert not admits(policy, Peer("a", {"y": ""}), 3) and not admits(policy, Peer("a", {"x": "1"}), 4)


RAY_POD = {
    "app.kubernetes.io/part-of": "glm4-serve",
    "ray.io/cluster": "glm4-serve-x7k2p",  # KubeRay's label: the generated cluster name
    "ray.io/node-type": "worker",
}
HEAD_POD = RAY_POD | {"ray.io/node-type": "head"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
# Ray's own ports: GCS, Ray client, dashboard, dashboard agent, metrics, a raylet/object manager
# port and a worker port (Ray picks the last two at random).
RAY_PORTS = [6379, 10001, 8265, 52365, 8080, 43521, 10002]

# (who, port, admitted)
REACHABILITY = [
    *[(Peer(APP_NAMESPACE, RAY_POD), port, True) for port in [*RAY_PORTS, 8000, 9000]],
    *[(Peer("elsewhere"), port, False) for port in RAY_PORTS],
    (Peer("elsewhere"), 8000, True),
    (Peer("elsewhere"), 9000, True),
    # The app's label alone, or a Ray pod of another namespace, is not one of this cluster's pods.
    *[(Peer(APP_NAMESPACE, {"app.kubernetes.io/part-of": "glm4-serve"}), port, False) for port in RAY_PORTS],
    *[(Peer("elsewhere", RAY_POD), port, False) for port in RAY_PORTS],
    (Peer("kuberay", OPERATOR), 8265, True),
    *[(Peer("kuberay", OPERATOR), port, False) for port in [6379, 10001, 52365, 8080]],
    (Peer("elsewhere", OPERATOR), 8265, False),
    (Peer("kuberay", PROMETHEUS), 8265, False),
    (Peer("monitoring", PROMETHEUS), 8080, True),
    *[(Peer("monitoring", PROMETHEUS), port, False) for port in [6379, 10001, 8265, 52365]],
    (Peer("elsewhere", PROMETHEUS), 8080, False),
    (Peer("monitoring", OPERATOR), 8080, False),
]


def case_id(case: tuple[Peer, int, bool]) -> str:
    peer, port, admitted = case
    who = peer.labels.get("app.kubernetes.io/name") or ("ray-pod" if "ray.io/cluster" in peer.labels else "pod")
    return f"{who}@{peer.namespace}:{port}-{'open' if admitted else 'closed'}"


@pytest.mark.parametrize("name", DOCUMENT_SETS)
@pytest.mark.parametrize(("peer", "port", "open_"), REACHABILITY, ids=[case_id(c) for c in REACHABILITY])
def test_each_port_is_open_to_its_peers_only(name, peer, port, open_):
    """Ray's ports to this namespace's Ray pods; 8000 and 9000 to clients on the workers, to the Ray
    pods only on the head; 8265 to the operator; 8080 to Prometheus."""
    policies = [d for d in documents(name) if d["kind"] == "NetworkPolicy"]
    assert admitted(policies, RAY_POD, peer, port) is open_
    is_ray_pod = "ray.io/cluster" in peer.labels and peer.namespace == APP_NAMESPACE
    head_open = open_ and (port not in (8000, 9000) or is_ray_pod)
    assert admitted(policies, HEAD_POD, peer, port) is head_open


def test_the_policy_names_the_namespace_the_docs_install_the_operator_in():
    install = re.findall(r"helm install kuberay-operator .* -n (\S+)", (ROOT / "docs/kubernetes.md").read_text())
    (namespace,) = set(install)
    assert admits(network_policy("base"), Peer(namespace, OPERATOR), 8265)


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_ray_token_authentication_is_on_and_left_to_kuberay(name):
    """KubeRay makes a token per RayCluster and sets RAY_AUTH_* in every Ray container.

    It leaves an env var a template already sets: a RAY_AUTH_MODE of our own would win
    over authOptions, so no template sets either.
    """
    (rayservice,) = rayservices(name)
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    major, minor, _ = (int(part) for part in cluster["rayVersion"].split("."))
    assert (major, minor) >= (2, 52)  # token authentication's first Ray release
    for template in pod_templates(rayservice):
        for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            assert not {e["name"] for e in container.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
    assert not {e["name"] for e in cluster["autoscalerOptions"].get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_only_the_autoscaler_holds_a_kubernetes_api_token(name):
    """No Ray container gets a service-account token; the autoscaler sidecar mounts one itself."""
    (rayservice,) = rayservices(name)
    cluster = rayservice["spec"]["rayClusterConfig"]
    for template in pod_templates(rayservice):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            assert all(not m["mountPath"].startswith(TOKEN_PATH) for m in container.get("volumeMounts", []))
            token_volumes = {v["name"] for v in spec.get("volumes", []) if "projected" in v}
            assert not token_volumes & {m["name"] for m in container.get("volumeMounts", [])}
    (mount,) = [m for m in cluster["autoscalerOptions"]["volumeMounts"] if m["mountPath"] == TOKEN_PATH]
    assert mount["readOnly"] is True
    head = cluster["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    sources = volume["projected"]["sources"]
    # What in-cluster clients read: the token, the cluster's CA and the namespace.
    token = next(s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s)
    assert token["path"] == "token" and token["expirationSeconds"] <= 3607
    assert any(s.get("configMap", {}).get("name") == "kube-root-ca.crt" for s in sources)
    assert any(i["path"] == "namespace" for s in sources for i in s.get("downwardAPI", {}).get("items", []))


def test_the_autoscaler_reads_its_token_where_the_mount_puts_it():
    """Ray's KubeRay node provider (the pinned version) reads the in-cluster token and CA here."""
    from ray.autoscaler._private.kuberay import node_provider

    assert node_provider.IN_CLUSTER_TOKEN_PATH == f"{TOKEN_PATH}/token"
    assert node_provider.IN_CLUSTER_CA_CERT_PATH == f"{TOKEN_PATH}/ca.crt"


def test_the_docs_say_how_to_reach_the_dashboard_with_the_token():
    text = (ROOT / "docs/kubernetes.md").read_text()
    assert "authOptions" in text and "auth_token" in text and "RAY_AUTH_TOKEN" in text


def volume_sources(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in spec.get("volumes", [])}


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_the_hub_token_reaches_only_the_download_job_and_the_weights_only_gpu_workers_read_only(name):
    """The Job fills the model cache with the token (a file of an optional Secret, HF_TOKEN_PATH);
    GPU workers mount the cache read-only and run offline; the head and CPU workers get neither."""
    docs = documents(name)
    (rayservice,) = rayservices(name)
    groups = worker_groups(rayservice)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    job_spec = job["spec"]["template"]["spec"]
    for spec in [job_spec, *(t["spec"] for t in pod_templates(rayservice))]:
        for container in spec["containers"]:
            assert all("secretKeyRef" not in e.get("valueFrom", {}) for e in container.get("env", [])), container
    (download,) = job_spec["containers"]
    token_file = Path({e["name"]: e.get("value") for e in download["env"]}["HF_TOKEN_PATH"])
    (mount,) = [m for m in download["volumeMounts"] if Path(m["mountPath"]) == token_file.parent]
    secret = volume_sources(job_spec)[mount["name"]]["secret"]
    assert mount["readOnly"] is True and secret["optional"] is True and secret["defaultMode"] & 0o007 == 0
    assert secret["secretName"] == "glm4-serve-hf-token"
    (cache,) = [m for m in download["volumeMounts"] if m["mountPath"] == "/models"]
    assert not cache.get("readOnly", False)  # the one writer
    for template in pod_templates(rayservice):
        volumes = volume_sources(template["spec"]).values()
        assert not [v for v in volumes if v.get("secret", {}).get("secretName") == "glm4-serve-hf-token"]
    for other in (rayservice["spec"]["rayClusterConfig"]["headGroupSpec"], groups["cpu"]):
        assert not [v for v in volume_sources(other["template"]["spec"]).values() if "persistentVolumeClaim" in v]
    gpu = groups["gpu"]["template"]["spec"]
    (container,) = gpu["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN_PATH" not in env
    (cache,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
    assert cache["readOnly"] is True
    assert volume_sources(gpu)[cache["name"]]["persistentVolumeClaim"]["readOnly"] is True


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_root_filesystems_are_read_only_and_uids_are_high(name):
    """Every container of ours: read-only root, writes to the pod's /tmp emptyDir (HOME there too),
    which has a size limit (past it the pod is evicted, not the node's disk filled), a uid of 10000
    or more (one no host account has)."""
    docs = documents(name)
    (rayservice,) = rayservices(name)
    specs = [t["spec"] for t in pod_templates(rayservice)]
    specs += [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Job", "StatefulSet")]
    for spec in specs:
        assert spec["securityContext"]["runAsUser"] >= 10000 and spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if container["image"].startswith("redis"):  # Redis and Sentinel: no HOME, config in /tmp
                assert env["CONF_DIR"] == "/tmp"
            else:
                assert env["HOME"].startswith("/tmp/")
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert volume_sources(spec)[tmp["name"]]["emptyDir"]["sizeLimit"]


HEAD = RAY_POD | {"ray.io/node-type": "head"}
GCS_STORE = "glm4-serve-redis"
GPU_WORKER = RAY_POD | {"ray.io/node-type": "worker", "ray.io/group": "gpu"}
REDIS_CLEANUP = RAY_POD | {"ray.io/node-type": "redis-cleanup"}  # KubeRay's Job: a copy of the head pod

# (who, admitted) to Redis's and the Sentinels' ports: the GCS on the head, KubeRay's clean-up Job,
# and the Redis pods themselves (replication, the Sentinels' watch) only.
REDIS_REACHABILITY = [
    (Peer(APP_NAMESPACE, HEAD), True),
    (Peer(APP_NAMESPACE, REDIS_CLEANUP), True),
    (Peer(APP_NAMESPACE, RAY_POD), False),  # a worker: runs replicas, no GCS
    (Peer(APP_NAMESPACE, {"app.kubernetes.io/part-of": "glm4-serve", "ray.io/node-type": "head"}), False),
    (Peer("elsewhere", HEAD), False),
    (Peer("kuberay", OPERATOR), False),
    (Peer("elsewhere"), False),
    (Peer(APP_NAMESPACE, {"app.kubernetes.io/name": "glm4-serve-redis"}), True),
    (Peer("elsewhere", {"app.kubernetes.io/name": "glm4-serve-redis"}), False),
]


@pytest.mark.parametrize("name", ["production", "production-incremental"])
@pytest.mark.parametrize("port", [6379, 26379])
@pytest.mark.parametrize(
    ("peer", "admitted"), REDIS_REACHABILITY, ids=[case_id((p, 0, a)) for p, a in REDIS_REACHABILITY]
)
def test_only_the_gcs_reaches_redis(name, port, peer, admitted):
    """Redis's own policy admits the head, KubeRay's clean-up Job and the Redis pods; the Ray pods'
    policy does not select Redis."""
    (redis,) = [
        d for d in documents(name) if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "glm4-serve-redis"
    ]
    redis_pod = redis["spec"]["template"]["metadata"]["labels"]
    policy = network_policy(name, "glm4-serve-redis")
    assert selects(policy["spec"]["podSelector"], redis_pod)
    assert not selects(network_policy(name)["spec"]["podSelector"], redis_pod)
    assert admits(policy, peer, port) is admitted


# (who, admitted) to the responses store's Redis and Sentinels: the GPU workers, where the model
# replicas keep responses, and the store's own pods only.
RESPONSES_STORE_REACHABILITY = [
    (Peer(APP_NAMESPACE, GPU_WORKER), True),
    (Peer(APP_NAMESPACE, RAY_POD | {"ray.io/node-type": "worker", "ray.io/group": "cpu"}), False),
    (Peer(APP_NAMESPACE, HEAD), False),
    (Peer("elsewhere", GPU_WORKER), False),
    (Peer(APP_NAMESPACE, {"app.kubernetes.io/name": "glm4-serve-responses-store"}), True),
    (Peer(APP_NAMESPACE, {"app.kubernetes.io/name": "glm4-serve-redis"}), False),
]


@pytest.mark.parametrize("port", [6379, 26379])
@pytest.mark.parametrize(
    ("peer", "admitted"),
    RESPONSES_STORE_REACHABILITY,
    ids=[case_id((p, 0, a)) for p, a in RESPONSES_STORE_REACHABILITY],
)
def test_only_the_model_replicas_reach_the_responses_store(port, peer, admitted):
    (store,) = [
        d
        for d in documents("production")
        if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "glm4-serve-responses-store"
    ]
    policy = network_policy("production", "glm4-serve-responses-store")
    assert selects(policy["spec"]["podSelector"], store["spec"]["template"]["metadata"]["labels"])
    assert admits(policy, peer, port) is admitted
