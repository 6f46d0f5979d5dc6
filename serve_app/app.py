"""Build the Ray Serve application from a serve config's ``args``.

This is the ``import_path`` of every config under ``deploy/``
(``serve_app.app:build_app``): ``serve run``, KubeRay's RayService and the tests
all start the application here. It validates the arguments, then binds the model's
deployment as the application's ingress
(:class:`~serve_app.deployments.model_server.DirectModelServer`: each model replica answers
its clients itself), the :class:`~serve_app.deployments.replica_picker.ReplicaPicker` that Serve's
HAProxy asks which replica takes each request, and, when per-key rate limits are
configured, the :class:`~serve_app.front_door.rate_limits.RateLimiter` every model replica
asks. Settings are read in :mod:`serve_app.config`; they act in the deployments.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from ray import serve
from ray.serve import Application, Deployment

from serve_app.config import parse_app_config
from serve_app.deployments.rate_limiter import RateLimiter
from serve_app.deployments.replica_picker import ReplicaPicker
from serve_app.serve_internals import haproxy_deregistration_s, haproxy_enabled, with_ingress_request_router

logger = logging.getLogger("ray.serve")

# The model deployment's class, by its import path: Serve imports it in each model replica, and
# the application's build (a process of its own for each application and each deploy) never
# imports vLLM (8 s of CPU there, for nothing: the config is checked against vLLM's own argument
# names read from its source, serve_app.vllm_internals).
MODEL_SERVER = "serve_app.deployments.model_server.DirectModelServer"
# The model replica's health check only reads the engine's state, so it runs often. A replica
# whose engine died exits by itself (serve_app.engine.engine_watch); the check is the backstop.
MODEL_HEALTH_CHECKS: dict[str, Any] = {"health_check_period_s": 2, "health_check_timeout_s": 30}
# Past its drain, how long Serve lets a stopping ReplicaPicker close before killing it.
PICKER_STOP_MARGIN_S = 5.0


def deployment(cls: type) -> Deployment:
    """The Serve deployment ``@serve.deployment`` made of ``cls`` (a type checker sees the class)."""
    return cast(Deployment, cls)


def build_app(args: dict[str, Any]) -> Application:
    """The model's deployment as the application's ingress, with the ReplicaPicker HAProxy asks.

    Without Serve's HAProxy (Ray started without deploy/cluster.env, as by a bare ``serve
    run``) Serve refuses an ingress request router: the model deployment is then the ingress,
    and Serve's Python proxy carries each answer from the replica it picked by load; with prefix
    routing that replica asks the ReplicaPicker (an init argument, not its ingress request router)
    which replica answers, and relays its answer when it is another.
    """
    config = parse_app_config(args)
    limits = config.ingress.rate_limits
    rate_limiter = None
    if limits is not None:
        rate_limiter = deployment(RateLimiter).options(name="rate-limiter", **limits.deployment).bind(limits)
    (model,) = config.models
    if config.ingress.applies_fair_share:
        model = model.with_priority_scheduling()
    model_server = serve.deployment(name=model.deployment_name, **MODEL_HEALTH_CHECKS)(MODEL_SERVER)
    server_options = model.resolved_direct_deployment(config.ingress.request_timeout_s)
    if not haproxy_enabled():
        logger.warning(
            "Serve's HAProxy is off (RAY_SERVE_ENABLE_HA_PROXY=1, deploy/cluster.env): "
            "answers go through Serve's Python proxy"
        )
        # Serve's proxy cannot read the prompt: with prefix routing, the replica it picks asks the
        # ReplicaPicker (by the model deployment's name: it holds no handle back) which answers.
        picker = deployment(ReplicaPicker).bind(model.deployment_name) if model.prefix_routing.enabled else None
        return model_server.options(**server_options).bind(model, config, rate_limiter, picker)
    server = model_server.options(**server_options).bind(model, config, rate_limiter)
    # A ReplicaPicker Serve stops keeps answering as long as a model replica would (Serve drains
    # only the ingress's replicas): an HAProxy process of the configuration before still sends
    # the requests of its open keep-alive connections to it (docs/operations.md).
    drain_s = haproxy_deregistration_s()
    picker = deployment(ReplicaPicker).options(
        graceful_shutdown_wait_loop_s=drain_s, graceful_shutdown_timeout_s=drain_s + PICKER_STOP_MARGIN_S
    )
    return with_ingress_request_router(server, picker.bind(server))
