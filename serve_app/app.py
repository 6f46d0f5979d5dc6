"""Build the Ray Serve application from a serve config's ``args``.

This is the ``import_path`` of every config under ``deploy/``
(``serve_app.app:build_app``): ``serve run``, KubeRay's RayService and the tests
all start the application here. It validates the arguments, then binds one
:class:`~serve_app.replica.deployment.ModelServer` deployment per model and the
:class:`~serve_app.ingress.deployment.Ingress` in front of them, and, when per-key rate limits
are configured, the :class:`~serve_app.ingress.rate_limits.RateLimiter` that every ingress
replica asks. With ``ingress.direct_streaming``, the one model's deployment is the
application's ingress (:class:`~serve_app.replica.front_door.DirectModelServer`) and the
:class:`~serve_app.replica_picker.ReplicaPicker` its ingress request router. Settings are read
in :mod:`serve_app.config`; they act in the deployments.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from ray.serve import Application, Deployment

from serve_app.config import AppConfig, ModelConfig, parse_app_config
from serve_app.ingress.deployment import Ingress
from serve_app.ingress.rate_limits import RateLimiter
from serve_app.priority_router import ROUTER_CLASS_PATH as PRIORITY_ROUTER_CLASS
from serve_app.replica.deployment import ModelServer
from serve_app.serve_internals import haproxy_enabled, with_ingress_request_router

logger = logging.getLogger("ray.serve")


def deployment(cls: type) -> Deployment:
    """The Serve deployment ``@serve.deployment`` made of ``cls`` (a type checker sees the class)."""
    return cast(Deployment, cls)


def build_app(args: dict[str, Any]) -> Application:
    config = parse_app_config(args)
    limits = config.ingress.rate_limits
    rate_limiter = None
    if limits is not None:
        rate_limiter = deployment(RateLimiter).options(name="rate-limiter", **limits.deployment).bind(limits)
    if config.ingress.direct_streaming:
        return direct_streaming_app(config, rate_limiter)
    handles = {model.name: relayed_model(model, config) for model in config.models}
    return deployment(Ingress).options(**config.ingress.resolved_deployment()).bind(config, handles, rate_limiter)


def relayed_model(model: ModelConfig, config: AppConfig) -> Application:
    """A model deployment the ingress relays requests to. With fair share, the engine schedules
    waiting requests by priority, and so does the request router (prefix-aware, or Serve's power
    of two choices in priority order) for those waiting in the ingress for a replica."""
    options = model.resolved_deployment(config.ingress.request_timeout_s)
    if config.ingress.applies_fair_share:
        model = model.with_priority_scheduling()
        options.setdefault("request_router_config", {"request_router_class": PRIORITY_ROUTER_CLASS})
    return (
        deployment(ModelServer)
        .options(name=model.deployment_name, **options)
        .bind(model, config.ingress.prompt_logprobs)
    )


def direct_streaming_app(config: AppConfig, rate_limiter: Application | None) -> Application:
    """The model deployment as the application's ingress, with the ReplicaPicker HAProxy asks.

    Without Serve's HAProxy (Ray started without deploy/cluster.env, as by a bare ``serve
    run``) Serve refuses an ingress request router: the model deployment is then the ingress
    alone, and Serve's Python proxy carries each answer from the replica its request router
    (prefix-aware) picked, still without an ingress replica in between.
    """
    from serve_app.replica.front_door import DirectModelServer
    from serve_app.replica_picker import ReplicaPicker

    (model,) = config.models
    if config.ingress.applies_fair_share:
        model = model.with_priority_scheduling()
    server = (
        deployment(DirectModelServer)
        .options(name=model.deployment_name, **model.resolved_direct_deployment(config.ingress.request_timeout_s))
        .bind(model, config, rate_limiter)
    )
    if not haproxy_enabled():
        logger.warning(
            "ingress.direct_streaming without Serve's HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1, deploy/cluster.env): "
            "answers go through Serve's Python proxy"
        )
        return server
    return with_ingress_request_router(server, deployment(ReplicaPicker).bind(server))
