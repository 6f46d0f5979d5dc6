"""What build_app binds for a shipped config: the data path it describes, and the parts it needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serve_app import app as app_module
from serve_app.deployments.options import MODEL_SERVER
from tests.serve_configs import app_args

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("haproxy", [True, False], ids=["with HAProxy", "without HAProxy"])
def test_the_model_deployment_is_the_ingress_and_asks_the_picker_only_with_haproxy(
    monkeypatch: pytest.MonkeyPatch, haproxy: bool
) -> None:
    """With Serve's HAProxy the ReplicaPicker is the model deployment's ingress request router;
    without it (a bare `serve run`) Serve would refuse one, so the model deployment is the ingress
    alone and Serve's Python proxy routes to it."""
    monkeypatch.setattr(app_module, "haproxy_enabled", lambda: haproxy)
    application = app_module.build_app(app_args("config.sim.yaml"))
    assert application._bound_deployment.name == "model-glm-4-9b-chat"
    router = application._ingress_request_router
    assert (router._bound_deployment.name if router is not None else None) == ("ReplicaPicker" if haproxy else None)


@pytest.mark.parametrize("prefix_routing", [True, False], ids=["prefix routing", "no prefix routing"])
def test_without_haproxy_the_model_replicas_ask_the_picker_when_routing_by_prefix(
    monkeypatch: pytest.MonkeyPatch, prefix_routing: bool
) -> None:
    """Serve's Python proxy cannot read the prompt: the replica it picks asks the ReplicaPicker,
    given to it (by the model deployment's name, since the picker holds no handle back)."""
    monkeypatch.setattr(app_module, "haproxy_enabled", lambda: False)
    args = app_args("config.sim.yaml")
    args["models"][0]["prefix_routing"] = {"enabled": prefix_routing}
    application = app_module.build_app(args)
    picker = application._bound_deployment.init_args[3]
    if prefix_routing:
        assert picker._bound_deployment.name == "ReplicaPicker"
        assert picker._bound_deployment.init_args == ("model-glm-4-9b-chat", None, False)  # (no API keys)
    else:
        assert picker is None


def test_a_replaced_picker_starts_its_successor_first_and_answers_as_long_as_a_model_replica_drains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A change of the application's arguments replaces the picker too. HAProxy processes of the
    configuration before keep sending their keep-alive connections' requests to the old one, for as
    long as Serve drains a model replica for them (its minimum direct-ingress drain)."""
    monkeypatch.setattr(app_module, "haproxy_enabled", lambda: True)
    monkeypatch.setattr(app_module, "haproxy_deregistration_s", lambda: 7.0)
    router = app_module.build_app(app_args("config.sim.yaml"))._ingress_request_router
    assert router is not None
    picker = router._bound_deployment
    config = picker._deployment_config
    assert config.max_surge_percent == 100
    assert config.graceful_shutdown_wait_loop_s == 7.0
    assert config.graceful_shutdown_timeout_s > 7.0


def test_two_limiters_each_keys_limiter_calls_kept_on_one() -> None:
    """Each API key's limiter calls go to one of the limiter's two replicas, chosen by Ray's
    consistent-hash router, with no fallback that would split a key's counts; the config may set
    its replicas."""
    args = app_args("config.sim.yaml")
    args["ingress"] |= {"api_keys": {"env": "GLM4_TEST_KEYS"}, "rate_limits": {"requests_per_minute": 5}}
    application = app_module.build_app(args)
    model = application._bound_deployment
    limiter = model.init_args[2]._bound_deployment
    assert limiter._deployment_config.num_replicas == 2
    router = limiter._deployment_config.request_router_config
    assert router.request_router_class.endswith("consistent_hash_router:ConsistentHashRouter")
    assert router.request_router_kwargs == {"num_fallback_replicas": 0}
    args["ingress"]["rate_limits"]["deployment"] = {"num_replicas": 3}
    limiter = app_module.build_app(args)._bound_deployment.init_args[2]._bound_deployment
    assert limiter._deployment_config.num_replicas == 3


@pytest.mark.parametrize("fair_share", [True, False], ids=["fair share", "no fair share"])
def test_with_fair_share_the_direct_replicas_engine_schedules_waiting_requests_by_priority(
    fair_share: bool,
) -> None:
    """Only where it applies: with API keys (without keys, one tenant)."""
    args = app_args("config.sim.yaml")
    args["ingress"] |= {"fair_share": fair_share, "api_keys": {"env": "GLM4_TEST_KEYS"}}
    application = app_module.build_app(args)
    model = application._bound_deployment.init_args[0]
    assert model.engine_args.get("scheduling_policy") == ("priority" if fair_share else None)
    del args["ingress"]["api_keys"]
    keyless = app_module.build_app(args)._bound_deployment.init_args[0]
    assert "scheduling_policy" not in keyless.engine_args


def test_building_the_application_imports_neither_vllm_nor_torch() -> None:
    """Serve builds each application in a process of its own, at every deploy: the model deployment
    is named by its import path (each replica imports it) and the config is checked against vLLM's
    names read from its source, so the build costs Ray's imports, not vLLM's (8 s of CPU)."""
    code = (
        "import sys, yaml; from serve_app.app import build_app; "
        "app = build_app(yaml.safe_load(open('deploy/config.yaml'))['applications'][0]['args']); "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules), app._bound_deployment.func_or_class)"
    )
    built = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert built.stdout.split() == ["[]", MODEL_SERVER]


def test_the_model_replicas_health_is_checked_every_2_s_unless_the_config_says_otherwise() -> None:
    args = app_args("config.yaml")
    for option in ("health_check_period_s", "health_check_timeout_s"):
        args["models"][0]["deployment"].pop(option, None)
    config = app_module.build_app(args)._bound_deployment._deployment_config
    assert (config.health_check_period_s, config.health_check_timeout_s) == (2, 30)
    args["models"][0]["deployment"] |= {"health_check_period_s": 5}
    assert app_module.build_app(args)._bound_deployment._deployment_config.health_check_period_s == 5


def test_each_model_replica_finds_the_deployments_class_by_its_import_path() -> None:
    """As Serve's replica loads a deployment named by import path (the build never imports it)."""
    from ray.serve._private.replica import _load_deployment_def_from_import_path

    from serve_app.deployments.model_server import ModelServer

    assert _load_deployment_def_from_import_path(MODEL_SERVER) is ModelServer
