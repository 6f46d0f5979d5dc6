"""Build the Ray Serve application from a serve config's ``args``.

This is the ``import_path`` of every config under ``deploy/``
(``serve_app.app:build_app``): ``serve run``, KubeRay's RayService and the tests
all start the application here. It validates the arguments, then binds the model's
deployment as the application's ingress
(:class:`~serve_app.deployments.model_server.ModelServer`: each model replica answers
its clients itself), the :class:`~serve_app.deployments.replica_picker.ReplicaPicker` that Serve's
HAProxy asks which replica takes each request, and, when per-key rate limits are
configured, the :class:`~serve_app.front_door.admission.rate_limits.RateLimiter` every model replica
asks. Settings are read in :mod:`serve_app.config`, turned into Serve's options in
:mod:`serve_app.deployments.options`, and act in the deployments.

Runs in the application's build: the Ray task Serve starts for each deploy of a config.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from ray import serve
from ray.serve import Application, Deployment

from serve_app.config import parse_app_config
from serve_app.deployments.options import MODEL_SERVER, model_server_options, picker_options, rate_limiter_options
from serve_app.deployments.rate_limiter import RateLimiter
from serve_app.deployments.replica_picker import ReplicaPicker
from serve_app.serve_internals import haproxy_deregistration_s, haproxy_enabled, with_ingress_request_router

logger = logging.getLogger("ray.serve")


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
        rate_limiter = deployment(RateLimiter).options(**rate_limiter_options(limits)).bind(limits)
    (model,) = config.models
    if config.ingress.applies_fair_share:
        model = model.with_priority_scheduling()
    options = model_server_options(model, config.ingress.request_timeout_s, config.ingress.open_calls)
    model_server = serve.deployment(**options)(MODEL_SERVER)
    if not haproxy_enabled():
        logger.warning(
            "Serve's HAProxy is off (RAY_SERVE_ENABLE_HA_PROXY=1, deploy/cluster.env): "
            "answers go through Serve's Python proxy"
        )
        # Serve's proxy cannot read the prompt: with prefix routing, the replica it picks asks the
        # ReplicaPicker (by the model deployment's name: it holds no handle back) which answers.
        picker = None
        if model.prefix_routing.enabled:
            picker = deployment(ReplicaPicker).bind(
                model.deployment_name, config.ingress.api_keys, config.ingress.isolates_prefix_cache
            )
        return model_server.bind(model, config, rate_limiter, picker)
    server = model_server.bind(model, config, rate_limiter)
    picker = deployment(ReplicaPicker).options(**picker_options(haproxy_deregistration_s()))
    picked = picker.bind(server, config.ingress.api_keys, config.ingress.isolates_prefix_cache)
    return with_ingress_request_router(server, picked)
