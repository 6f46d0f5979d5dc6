"""What build_app binds for a shipped config: the data path it describes, and the parts it needs."""

from __future__ import annotations

import pytest

from serve_app import app as app_module
from tests.unit.test_config import app_args


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


@pytest.mark.parametrize("fair_share", [True, False], ids=["fair share", "no fair share"])
def test_with_fair_share_the_direct_replicas_engine_schedules_waiting_requests_by_priority(
    fair_share: bool,
) -> None:
    """Only where it applies: with API keys (without keys, one tenant)."""
    args = app_args("config.sim.yaml")
    args["ingress"] |= {"fair_share": fair_share, "api_keys": {"env": "GLM4_TEST_KEYS"}}
    application = app_module.build_app(args)
    (model, _config, _limiter) = application._bound_deployment.init_args
    assert model.engine_args.get("scheduling_policy") == ("priority" if fair_share else None)
    del args["ingress"]["api_keys"]
    (keyless, _config, _limiter) = app_module.build_app(args)._bound_deployment.init_args
    assert "scheduling_policy" not in keyless.engine_args
