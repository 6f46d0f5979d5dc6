"""The Kubernetes manifests under k8s/: valid for KubeRay and Kubernetes, one serve config.

Nothing here needs a cluster. RayService documents are checked against KubeRay's v1 CRD
schemas (tests/data/kuberay, verbatim from the KubeRay release its SOURCE.txt names),
their serveConfigV2 against Ray's own ServeDeploySchema, and core objects with
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

from serve_app.config import parse_app_config
from serve_app.deployments.options import model_options
from tests.repo.k8s_manifests import (
    CRD_FILES,
    DOCUMENT_SETS,
    K8S,
    KUBERNETES_VERSION,
    OVERLAYS,
    app_args,
    crd_validator,
    documents,
    pod_templates,
    rayservices,
    serve_config_file,
    worker_groups,
)
from tools.cluster_env import cluster_env


def test_there_is_a_small_a_production_and_an_fp8_overlay_and_one_for_incremental_upgrades():
    assert OVERLAYS == ["fp8", "production", "production-incremental", "single-gpu"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_kuberay_documents_validate_against_the_crd_schemas(name):
    kinds = [d for d in documents(name) if d["kind"] in CRD_FILES]
    assert kinds, f"{name}: no KubeRay documents"
    for doc in kinds:
        assert doc["apiVersion"] == "ray.io/v1"
        crd_validator(doc["kind"]).validate(doc)


def test_the_crd_schema_check_catches_a_wrong_field_type():
    """The schema is strict enough to be worth running: a string replica count fails."""
    bad = yaml.safe_load((K8S / "base" / "rayservice.yaml").read_text())
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="eight"):
        crd_validator("RayService").validate(bad)


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_every_ray_container_has_the_cluster_env_of_deploy_cluster_env(name):
    """Serve's cluster settings are read where Ray starts: every head and worker container has them."""
    expected = cluster_env()
    assert expected, "deploy/cluster.env is empty"
    (rayservice,) = rayservices(name)
    for template in pod_templates(rayservice):
        for container in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {k: env.get(k) for k in expected} == expected, container["name"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_serve_config_is_a_file_of_deploy_verbatim_and_valid_for_ray(name):
    """deploy/config.yaml (base, production overlays) or a variant's (single-gpu, fp8)."""
    (rayservice,) = rayservices(name)
    text = rayservice["spec"]["serveConfigV2"]
    source = serve_config_file(name)
    assert text == source.read_text(), f"serveConfigV2 differs from {source.name}: run `make k8s-sync`"
    ServeDeploySchema.model_validate(yaml.safe_load(text))


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_no_model_a_cluster_serves_runs_the_simulated_engine(name):
    """The simulated engine (and with it the simulation switchboard, which tests use to pause,
    fail or hang an engine) exists only where a model's config asks for it: never in a config
    a RayService carries."""
    (rayservice,) = rayservices(name)
    for application in yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]:
        for model in application["args"]["models"]:
            assert model.get("simulated_engine") is None, (name, model["name"])


def sync_module():
    sys.path.insert(0, str(K8S))
    try:
        import sync_serve_config
    finally:
        sys.path.remove(str(K8S))
    return sync_serve_config


@pytest.mark.parametrize("variant", ["single-gpu", "fp8", "w4a16"])
def test_each_variant_is_production_with_its_patch_applied(variant):
    """Every difference between a variant's serve config and production's is an operation of its patch file."""
    sync = sync_module()
    assert variant in sync.VARIANTS
    production = yaml.safe_load(sync.SERVE_CONFIG.read_text())
    operations = yaml.safe_load(sync.patch_file(variant).read_text())
    config = yaml.safe_load(sync.config_file(variant).read_text())
    assert config == sync.patched(production, operations) != production


def test_the_single_gpu_variant_runs_one_replica_and_no_surge():
    (model,) = yaml.safe_load(sync_module().config_file("single-gpu").read_text())["applications"][0]["args"]["models"]
    assert model["deployment"]["autoscaling_config"]["max_replicas"] == 1
    assert model["deployment"]["max_surge_percent"] == 0


def test_the_fp8_overlay_runs_its_replicas_on_the_gpus_its_serve_config_names():
    """The serve config asks Ray for H100s; the GPU group's pods go to H100 nodes and tell the
    autoscaler they offer that resource, or a replica waiting for one would never get a pod."""
    (rayservice,) = rayservices("fp8")
    (model,) = app_args(rayservice)["models"]
    assert model["engine_args"]["quantization"] == "fp8_per_tensor"
    assert model["engine_args"]["kv_cache_dtype"] == "fp8"
    accelerator = model["deployment"]["ray_actor_options"]["accelerator_type"]
    gpu = worker_groups(rayservice)["gpu"]
    assert gpu["resources"] == {f"accelerator_type:{accelerator}": "1"}
    assert gpu["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"].startswith(f"NVIDIA-{accelerator}-")


def test_a_patch_that_no_longer_applies_is_an_error():
    sync = sync_module()
    document = {"a": [{"b": 1}]}
    assert sync.patched(document, [{"op": "replace", "path": "/a/0/b", "value": 2}]) == {"a": [{"b": 2}]}
    assert sync.patched(document, [{"op": "add", "path": "/a/0/c", "value": 3}]) == {"a": [{"b": 1, "c": 3}]}
    assert sync.patched(document, [{"op": "remove", "path": "/a/0/b"}]) == {"a": [{}]}
    assert document == {"a": [{"b": 1}]}
    with pytest.raises(KeyError, match="/a/0/x"):
        sync.patched(document, [{"op": "replace", "path": "/a/0/x", "value": 2}])
    with pytest.raises(IndexError):
        sync.patched(document, [{"op": "replace", "path": "/a/1/b", "value": 2}])


def test_sync_command_rewrites_only_the_serve_config_block():
    with_serve_config = sync_module().with_serve_config
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
def test_each_gpu_worker_requests_exactly_one_gpu_and_the_head_and_cpu_workers_none(name):
    (rayservice,) = rayservices(name)
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = worker_groups(rayservice)
    assert sorted(groups) == ["cpu", "gpu"]
    (gpu_container,) = groups["gpu"]["template"]["spec"]["containers"]
    resources = gpu_container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
    for group in groups.values():
        assert 1 <= group["minReplicas"] <= group["maxReplicas"]
    for template in (cluster["headGroupSpec"]["template"], groups["cpu"]["template"]):
        for container in template["spec"]["containers"]:
            assert not any("gpu" in k for k in container.get("resources", {}).get("limits", {}))
    # No Serve replica on the head: it offers Ray no CPUs and no GPUs.
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    (model,) = app_args(rayservice)["models"]
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


def drain_seconds(rayservice: dict) -> dict[str, float]:
    """Each worker group's longest replica drain: graceful_shutdown_timeout_s as the app resolves it
    (the CPU group's picker and rate limiter keep Serve's default: they hold no answers)."""
    from ray.serve._private.config import DeploymentConfig

    config = parse_app_config(app_args(rayservice))
    (model,) = config.models
    return {
        "gpu": model_options(model)["graceful_shutdown_timeout_s"],
        "cpu": DeploymentConfig().graceful_shutdown_timeout_s,
    }


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_autoscaling_is_on_and_no_worker_is_killed_before_its_replicas_drained(name):
    (rayservice,) = rayservices(name)
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    drains = drain_seconds(rayservice)
    for group_name, group in worker_groups(rayservice).items():
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] > drains[group_name]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
@pytest.mark.parametrize("group", ["gpu"])
def test_api_keys_come_from_a_required_secret_where_clients_are_answered(name, group):
    """The serve config's key file is a mounted Secret where replicas answer clients: the GPU
    workers, whose model replicas answer clients themselves."""
    (rayservice,) = rayservices(name)
    ingress = app_args(rayservice)["ingress"]
    keys_file = Path(ingress["api_keys"]["file"])
    spec = worker_groups(rayservice)[group]["template"]["spec"]
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
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "glm4-serve"]
    assert all(policy["spec"]["podSelector"]["matchLabels"].items() <= lab.items() for lab in labels)
    # ...and the label KubeRay puts on every pod of a RayCluster.
    assert policy["spec"]["podSelector"]["matchExpressions"] == [{"key": "ray.io/cluster", "operator": "Exists"}]
    ray_budgets = [
        d
        for d in docs
        if d["kind"] == "PodDisruptionBudget" and d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/part-of")
    ]
    budgets = {d["spec"]["selector"]["matchLabels"].get("ray.io/group", "head"): d for d in ray_budgets}
    assert sorted(budgets) == ["cpu", "gpu", "head"]  # one per worker group (KubeRay's label ray.io/group)
    for group_name, group in worker_groups(rayservice).items():
        wanted = dict(budgets[group_name]["spec"]["selector"]["matchLabels"])
        wanted.pop("ray.io/group")
        assert wanted.items() <= group["template"]["metadata"]["labels"].items()
        assert budgets[group_name]["spec"]["maxUnavailable"] == 1
    # The head: by the label KubeRay gives it (ray.io/node-type), and never evicted.
    head_labels = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert budgets["head"]["spec"]["selector"]["matchLabels"] == head_labels | {"ray.io/node-type": "head"}
    assert budgets["head"]["spec"]["maxUnavailable"] == 0


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_workers_drain_their_node_before_they_stop(name):
    """The preStop hook drains the node within the grace period, leaving each replica its
    whole graceful_shutdown_timeout_s before the drain's deadline (Serve stops a replica it
    cannot move at the deadline minus that timeout)."""
    (rayservice,) = rayservices(name)
    drains = drain_seconds(rayservice)
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "serve_app.ops.node_drain"]
        grace_s = int(command[command.index("--grace-s") + 1])
        assert drains[group["groupName"]] < grace_s < spec["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_no_single_node_or_head_carries_every_stream(name):
    """Client traffic skips the head's proxy; each group's pods spread over nodes and zones, per cluster."""
    (rayservice,) = rayservices(name)
    assert rayservice["spec"]["excludeHeadPodFromServeSvc"] is True
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        template = group["template"]
        spread = {c["topologyKey"]: c for c in template["spec"]["topologySpreadConstraints"]}
        assert set(spread) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        for constraint in spread.values():
            assert constraint["maxSkew"] == 1 and constraint["matchLabelKeys"] == ["ray.io/cluster"]
            wanted = dict(constraint["labelSelector"]["matchLabels"])
            assert wanted.pop("ray.io/group") == group["groupName"]  # KubeRay's own label
            assert wanted.items() <= template["metadata"]["labels"].items()


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_the_weights_job_and_the_gpu_workers_wait_name_the_checkpoints_served(name):
    """The Job downloads, and GPU pods wait for, exactly the checkpoints of the set's serveConfigV2."""
    from serve_app.ops.model_download import checkpoints

    (rayservice,) = rayservices(name)
    served = checkpoints(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    assert served
    (job,) = [d for d in documents(name) if d["kind"] == "Job"]
    (download,) = job["spec"]["template"]["spec"]["containers"]
    (wait,) = worker_groups(rayservice)["gpu"]["template"]["spec"]["initContainers"]
    for command, mode in ((download["command"], []), (wait["command"], ["--wait"])):
        assert command[:3] == ["python", "-m", "serve_app.ops.model_download"] and command[3:-1] == mode
        config = yaml.safe_load((K8S.parent / command[-1]).read_text())  # the image's WORKDIR holds deploy/
        assert checkpoints(config) == served


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_the_grpc_port_is_served_exposed_and_bounded_like_the_http_port(name):
    """The serve config's gRPC port is on the clients' Service and on every Ray container (each may run a
    proxy), and the proxy's largest message is the ingress's largest body (Ray's default is 2 GiB)."""
    (rayservice,) = rayservices(name)
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    port = serve_config["grpc_options"]["port"]
    service_ports = {p["name"]: p for p in rayservice["spec"]["serveService"]["spec"]["ports"]}
    assert (service_ports["grpc"]["port"], service_ports["grpc"]["appProtocol"]) == (port, "grpc")
    limit = str(parse_app_config(app_args(rayservice)).ingress.max_request_body_bytes)
    for template in pod_templates(rayservice):
        (ray,) = [c for c in template["spec"]["containers"] if c["name"].startswith("ray-")]
        assert {"name": "grpc", "containerPort": port} in ray["ports"], ray["name"]
        assert {"name": "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "value": limit} in ray["env"], ray["name"]
