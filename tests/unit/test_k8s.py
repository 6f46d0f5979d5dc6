"""The Kubernetes manifests under k8s/: valid for KubeRay and Kubernetes, one serve config.

Nothing here needs a cluster. RayService documents are checked against KubeRay's v1 CRD
schemas (the directory in KUBERAY_CRD_DIR, which .ci/run sets; ../shared/kuberay by
default), their serveConfigV2 against Ray's own ServeDeploySchema, and core objects with
kubernetes-validate. Each overlay is checked as `kubectl kustomize` renders it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from tests.unit.k8s_manifests import (
    CRD_FILES,
    DOCUMENT_SETS,
    K8S,
    KUBERNETES_VERSION,
    OVERLAYS,
    SERVE_CONFIG,
    crd_schema,
    documents,
    pod_templates,
    rayservices,
)


def test_there_is_a_small_and_a_production_overlay():
    assert OVERLAYS == ["production", "single-gpu"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_kuberay_documents_validate_against_the_crd_schemas(name):
    kinds = [d for d in documents(name) if d["kind"] in CRD_FILES]
    assert kinds, f"{name}: no KubeRay documents"
    for doc in kinds:
        assert doc["apiVersion"] == "ray.io/v1"
        jsonschema.validate(doc, crd_schema(doc["kind"]))


def test_the_crd_schema_check_catches_a_wrong_field_type():
    """The schema is strict enough to be worth running: a string replica count fails."""
    bad = yaml.safe_load((K8S / "base" / "rayservice.yaml").read_text())
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="eight"):
        jsonschema.validate(bad, crd_schema("RayService"))


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_serve_config_is_deploy_config_yaml_verbatim_and_valid_for_ray(name):
    (rayservice,) = rayservices(name)
    text = rayservice["spec"]["serveConfigV2"]
    assert text == SERVE_CONFIG.read_text(), "serveConfigV2 differs from deploy/config.yaml: run `make k8s-sync`"
    ServeDeploySchema.model_validate(yaml.safe_load(text))


def test_sync_command_rewrites_only_the_serve_config_block():
    sys.path.insert(0, str(K8S))
    try:
        from sync_serve_config import with_serve_config
    finally:
        sys.path.remove(str(K8S))
    manifest = "spec:\n  serveConfigV2: |\n    old: 1\n\n    older: 2\n  rayClusterConfig:\n    x: 1\n"
    synced = with_serve_config(manifest, "# a comment\napplications: []\n\nproxy_location: EveryNode\n")
    assert yaml.safe_load(synced) == {
        "spec": {
            "serveConfigV2": "# a comment\napplications: []\n\nproxy_location: EveryNode\n",
            "rayClusterConfig": {"x": 1},
        }
    }
    result = subprocess.run(
        [sys.executable, str(K8S / "sync_serve_config.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_core_objects_validate_for_kubernetes(name):
    core = [d for d in documents(name) if d["kind"] not in CRD_FILES]
    assert {d["kind"] for d in core} >= {"PersistentVolumeClaim", "PodDisruptionBudget", "NetworkPolicy"}
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_pod_templates_validate_as_kubernetes_pod_templates(name):
    """KubeRay embeds core PodTemplateSpecs; check them as Kubernetes would, strictly."""
    (rayservice,) = rayservices(name)
    for template in pod_templates(rayservice):
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_each_gpu_worker_requests_exactly_one_gpu_and_the_head_none(name):
    (rayservice,) = rayservices(name)
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        resources = container["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
        assert 1 <= group["minReplicas"] <= group["maxReplicas"]
    head = cluster["headGroupSpec"]
    for container in head["template"]["spec"]["containers"]:
        assert not any("gpu" in k for k in container.get("resources", {}).get("limits", {}))
    # No Serve replica on the head: it offers Ray no CPUs and no GPUs.
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (model,) = serve["applications"][0]["args"]["models"]
    assert model["deployment"]["ray_actor_options"]["num_gpus"] == 1


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_nothing_runs_as_root(name):
    (rayservice,) = rayservices(name)
    for template in pod_templates(rayservice):
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
        for container in template["spec"]["containers"]:
            security = container["securityContext"]
            assert security.get("runAsUser", pod["runAsUser"]) != 0
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
    autoscaler = rayservice["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert autoscaler["runAsNonRoot"] is True and autoscaler["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_gpu_autoscaling_and_zero_downtime_upgrades_are_on(name):
    (rayservice,) = rayservices(name)
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert rayservice["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (model,) = serve["applications"][0]["args"]["models"]
    # A draining worker pod is not killed before its replica has finished its streams.
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > model["deployment"]["graceful_shutdown_timeout_s"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_api_keys_come_from_a_required_secret_where_the_ingress_runs(name):
    """The serve config's key file is a mounted Secret on every worker (where the ingress runs)."""
    (rayservice,) = rayservices(name)
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    keys_file = Path(serve["applications"][0]["args"]["ingress"]["api_keys"]["file"])
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == keys_file.parent]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == "glm4-serve-api-keys" and not secret.get("optional", False)
        assert "items" not in secret or keys_file.name in {i["path"] for i in secret["items"]}
        # Readable by the pod's group (fsGroup), not by others.
        assert secret["defaultMode"] & 0o007 == 0 and secret["defaultMode"] & 0o040
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_the_policies_select_the_ray_pods(name):
    """The PodDisruptionBudget and NetworkPolicy select by labels the pod templates carry."""
    docs = documents(name)
    (rayservice,) = rayservices(name)
    labels = [t["metadata"]["labels"] for t in pod_templates(rayservice)]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert all(policy["spec"]["podSelector"]["matchLabels"].items() <= lab.items() for lab in labels)
    (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    wanted = dict(budget["spec"]["selector"]["matchLabels"])
    assert wanted.pop("ray.io/node-type") == "worker"  # KubeRay's own label on worker pods
    assert all(wanted.items() <= lab.items() for lab in labels)


def test_overlays_size_the_gpu_group_differently():
    def bounds(overlay: str) -> tuple[int, int]:
        (rayservice,) = rayservices(overlay)
        (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        return group["minReplicas"], group["maxReplicas"]

    assert bounds("single-gpu") == (1, 1)
    low, high = bounds("production")
    assert low >= 2 and high == 8  # deploy/config.yaml's max_replicas: one GPU pod per replica


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_gpu_workers_drain_their_node_before_they_stop(name):
    """The preStop hook drains the node within the grace period, leaving each replica its
    whole graceful_shutdown_timeout_s before the drain's deadline (Serve stops a replica it
    cannot move at the deadline minus that timeout)."""
    (rayservice,) = rayservices(name)
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (model,) = serve["applications"][0]["args"]["models"]
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "serve_app.node_drain"]
        grace_s = int(command[command.index("--grace-s") + 1])
        assert model["deployment"]["graceful_shutdown_timeout_s"] < grace_s < spec["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_no_single_node_or_head_carries_every_stream(name):
    """Client traffic skips the head's proxy; GPU pods spread over nodes and zones, per cluster."""
    (rayservice,) = rayservices(name)
    assert rayservice["spec"]["excludeHeadPodFromServeSvc"] is True
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        template = group["template"]
        spread = {c["topologyKey"]: c for c in template["spec"]["topologySpreadConstraints"]}
        assert set(spread) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        for constraint in spread.values():
            assert constraint["maxSkew"] == 1 and constraint["matchLabelKeys"] == ["ray.io/cluster"]
            wanted = dict(constraint["labelSelector"]["matchLabels"])
            assert wanted.pop("ray.io/node-type") == "worker"  # KubeRay's own label
            assert wanted.items() <= template["metadata"]["labels"].items()
