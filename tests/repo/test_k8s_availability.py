"""No single point of failure in the manifests: replicas, where they live, rollouts, the head's state.

Nothing here needs a cluster: the rendered overlays are read with the rules of the parts that
act on them (Serve's rollout surge, Ray's scheduling by logical CPUs, KubeRay's validation of
upgrade options). What a pod's drain does is proven on real Ray in tests/e2e/test_node_drain.py.
"""

from __future__ import annotations

import pytest
import yaml

from serve_app.config import parse_app_config
from serve_app.deployments.options import model_options, picker_options, rate_limiter_options
from tests.repo.k8s_manifests import DOCUMENT_SETS, app_args, documents, rayservices, worker_groups

PRODUCTION_SETS = ["base", "production", "production-incremental"]


def surge(max_surge_percent: int, replicas: int) -> int:
    """Extra replicas Serve starts during a rollout (ray/serve/_private/deployment_state.py: an integer ceiling)."""
    return (max_surge_percent * replicas + 99) // 100


def logical_cpus(group: dict) -> float:
    return float(group["rayStartParams"]["num-cpus"])


def test_the_surge_rule_is_serves():
    """Serve's own arithmetic, read from the pinned source, is the one used here."""
    import inspect

    from ray.serve._private.deployment_state import DeploymentState

    assert "surge = (surge_percent * target + 99) // 100" in inspect.getsource(DeploymentState._surge_replicas_to_start)
    assert [surge(25, n) for n in (1, 4, 5, 8)] == [1, 1, 2, 2]


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_a_model_rollout_always_finds_its_gpus(name):
    """The GPU group holds max_replicas plus the surge: replacements start before old replicas stop,
    so a surge replica that can never get a GPU would hold the rollout forever."""
    (rayservice,) = rayservices(name)
    (model,) = parse_app_config(app_args(rayservice)).models
    options = model_options(model)
    high = options["autoscaling_config"]["max_replicas"]
    gpu = worker_groups(rayservice)["gpu"]
    assert gpu["maxReplicas"] >= high + surge(options.get("max_surge_percent", 0), high)
    assert gpu["minReplicas"] >= options["autoscaling_config"]["min_replicas"]  # warm GPUs for the minimum


@pytest.mark.parametrize("name", PRODUCTION_SETS)
def test_production_keeps_two_model_replicas_on_two_gpu_pods(name):
    """One engine's death or one pod's drain leaves a replica serving; the budget evicts one GPU pod at a time."""
    (rayservice,) = rayservices(name)
    (model,) = app_args(rayservice)["models"]
    assert model["deployment"]["autoscaling_config"]["min_replicas"] >= 2
    assert worker_groups(rayservice)["gpu"]["minReplicas"] >= 2
    (budget,) = [
        d
        for d in documents(name)
        if d["kind"] == "PodDisruptionBudget" and d["spec"]["selector"]["matchLabels"].get("ray.io/group") == "gpu"
    ]
    assert budget["spec"]["maxUnavailable"] == 1


def test_single_gpu_says_what_it_gives_up():
    """One GPU: one replica, no surge, and no automatic cluster upgrade (a new cluster would wait for a GPU)."""
    (rayservice,) = rayservices("single-gpu")
    (model,) = app_args(rayservice)["models"]
    assert model["deployment"]["autoscaling_config"]["max_replicas"] == 1
    assert model["deployment"]["max_surge_percent"] == 0
    assert rayservice["spec"]["upgradeStrategy"] == {"type": "None"}
    assert worker_groups(rayservice)["gpu"]["maxReplicas"] == 1


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_a_gpu_worker_offers_ray_only_its_model_replicas_cpus(name):
    """No other replica that asks for CPU (the rate limiter) fits beside a model replica, so none
    keeps a GPU pod alive; it runs on the CPU group. (The pickers ask for none: Serve pins them
    to every node with a proxy.)"""
    (rayservice,) = rayservices(name)
    config = parse_app_config(app_args(rayservice))
    (model,) = config.models
    model_cpus = model_options(model)["ray_actor_options"]["num_cpus"]
    groups = worker_groups(rayservice)
    assert logical_cpus(groups["gpu"]) == model_cpus
    (container,) = groups["cpu"]["template"]["spec"]["containers"]
    assert float(container["resources"]["limits"]["cpu"]) >= logical_cpus(groups["cpu"])
    # Proxies run where replicas run (and never hold a node: they ask for no CPU).
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"])["proxy_location"] == "EveryNode"


@pytest.mark.parametrize("name", DOCUMENT_SETS)
def test_the_limiter_runs_two_replicas_on_the_cpu_workers_never_the_head(name):
    """Two, so one's death leaves the other answering; each asks Ray for CPU, so the head (started
    with num-cpus 0) never takes one, nor does a GPU worker (its CPUs are its model replica's:
    above); and both fit one CPU worker, so one CPU pod's loss leaves room. (The pickers ask for
    none: Serve pins them to every node that runs a proxy, the head and the GPU workers included,
    one on each.)"""
    (rayservice,) = rayservices(name)
    config = parse_app_config(app_args(rayservice))
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert config.ingress.rate_limits is not None
    options = rate_limiter_options(config.ingress.rate_limits)
    cpus = options["ray_actor_options"]["num_cpus"]
    assert options["num_replicas"] >= 2 and cpus > 0, options
    assert options["num_replicas"] * cpus <= logical_cpus(worker_groups(rayservice)["cpu"])
    assert "ray_actor_options" not in picker_options(drain_s=1.0)


@pytest.mark.parametrize("name", PRODUCTION_SETS)
def test_production_cpu_workers_are_two_pods_at_least(name):
    (rayservice,) = rayservices(name)
    assert worker_groups(rayservice)["cpu"]["minReplicas"] >= 2


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("base", "NewCluster"),
        ("production", "NewCluster"),
        ("production-incremental", "NewClusterWithIncrementalUpgrade"),
        ("single-gpu", "None"),
    ],
)
def test_each_set_has_its_upgrade_strategy(name, strategy):
    (rayservice,) = rayservices(name)
    assert rayservice["spec"]["upgradeStrategy"]["type"] == strategy


def test_the_incremental_upgrade_passes_kuberays_validation():
    """KubeRay 1.7's ValidateClusterUpgradeOptions: autoscaling on, a step no larger than the
    surge, a positive interval, a GatewayClass named."""
    (rayservice,) = rayservices("production-incremental")
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    options = rayservice["spec"]["upgradeStrategy"]["clusterUpgradeOptions"]
    assert 0 < options["stepSizePercent"] <= options.get("maxSurgePercent", 100) <= 100
    assert options["intervalSeconds"] > 0 and options["gatewayClassName"]


REDIS_SETS = ["production", "production-incremental", "fp8"]
GCS_STORE, RESPONSES_STORE = "glm4-serve-redis", "glm4-serve-responses-store"  # the two Redis sets


def redis_pod(name: str, redis_set: str = GCS_STORE) -> tuple[dict, dict]:
    """A Redis StatefulSet of a set of manifests and its pod template."""
    (redis,) = [d for d in documents(name) if d["kind"] == "StatefulSet" and d["metadata"]["name"] == redis_set]
    return redis, redis["spec"]["template"]


@pytest.mark.parametrize("name", REDIS_SETS)
def test_the_head_keeps_its_state_in_redis(name):
    """GCS fault tolerance: the address is the Sentinels' Service (Ray's GCS asks a Sentinel for the
    primary), the password the Secret that Redis and the Sentinels read."""
    docs = documents(name)
    (rayservice,) = rayservices(name)
    options = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, port = options["redisAddress"].split(":")
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host]
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    _, pod = redis_pod(name)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (sentinel,) = [c for c in pod["spec"]["containers"] if c["name"] == "sentinel"]
    assert service_port["targetPort"] in {p["name"] for p in sentinel["ports"]}
    secret = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    (auth,) = [v for v in pod["spec"]["volumes"] if v.get("secret", {}).get("secretName") == secret["name"]]
    for container in pod["spec"]["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == auth["name"]]
        assert env["REDIS_PASSWORD_FILE"] == f"{mount['mountPath']}/{secret['key']}"


@pytest.mark.parametrize("redis_set", [GCS_STORE, RESPONSES_STORE])
@pytest.mark.parametrize("name", REDIS_SETS)
def test_the_redis_set_has_no_single_pod(name, redis_set):
    """Three pods, one a node, one evicted at a time; each Redis's data on a volume of its own.
    (That a primary's loss is survived, by the scripts shipped here, is proven on real processes in
    tests/e2e/test_gcs_store.py.)"""
    redis, pod = redis_pod(name, redis_set)
    assert redis["spec"]["replicas"] == 3
    (spread,) = [c for c in pod["spec"]["topologySpreadConstraints"] if c["topologyKey"] == "kubernetes.io/hostname"]
    assert spread["whenUnsatisfiable"] == "DoNotSchedule" and spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (budget,) = [
        d
        for d in documents(name)
        if d["kind"] == "PodDisruptionBudget"
        and d["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ]
    assert budget["spec"]["maxUnavailable"] == 1
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "redis"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["DATA_DIR"]]
    assert data["name"] in {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    # The pods' own names resolve before they are ready: the scripts find each other by them.
    (headless,) = [
        d for d in documents(name) if d["kind"] == "Service" and d["metadata"]["name"] == redis["spec"]["serviceName"]
    ]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    sentinels = env["SENTINELS"].split()
    assert sentinels == [f"{redis['metadata']['name']}-{i}.{headless['metadata']['name']}:26379" for i in range(3)]
    assert env["SEED_HOST"] == f"{redis['metadata']['name']}-0.{headless['metadata']['name']}"


@pytest.mark.parametrize("name", REDIS_SETS)
def test_the_model_replicas_find_the_responses_store_through_its_sentinels(name):
    """The serve config's store is the responses set's primary, asked of its Sentinels' Service by the
    name its Sentinels monitor, with the password of the Secret its pods read, mounted as a file on
    the GPU workers, which run the model replicas; its Redis is bounded in memory."""
    docs = documents(name)
    (rayservice,) = rayservices(name)
    store = app_args(rayservice)["ingress"]["responses_store"]["redis"]
    gpu = worker_groups(rayservice)["gpu"]["template"]["spec"]
    (worker,) = gpu["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    host, port = env[store["url_env"]].removeprefix("redis://").split(":")
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host]
    _, pod = redis_pod(name, RESPONSES_STORE)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    (sentinel,) = [c for c in pod["spec"]["containers"] if c["name"] == "sentinel"]
    sentinel_env = {e["name"]: e.get("value") for e in sentinel["env"]}
    assert sentinel_env["MASTER_NAME"] == store["sentinel_master"] and sentinel_env["MAXMEMORY"]
    (auth,) = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v]
    (mount,) = [m for m in worker["volumeMounts"] if store["password_file"].startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in gpu["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == auth and mount["readOnly"] is True


@pytest.mark.parametrize("name", ["base", "single-gpu"])
def test_sets_without_redis_do_not_ask_for_it(name):
    (rayservice,) = rayservices(name)
    assert "gcsFaultToleranceOptions" not in rayservice["spec"]["rayClusterConfig"]
    assert not [d for d in documents(name) if d["kind"] == "StatefulSet"]
