"""Build the Ray Serve application from a serve config's ``args``.

This is the ``import_path`` of every config under ``deploy/``
(``serve_app.app:build_app``): ``serve run``, KubeRay's RayService and the tests
all start the application here. It validates the arguments, then binds one
:class:`~serve_app.replica.deployment.ModelServer` deployment per model and the
:class:`~serve_app.ingress.deployment.Ingress` in front of them, and, when per-key rate limits
are configured, the :class:`~serve_app.ingress.rate_limits.RateLimiter` that every ingress
replica asks. Settings are read in
:mod:`serve_app.config`; they act in the deployments.
"""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application, Deployment

from serve_app.config import parse_app_config
from serve_app.ingress.deployment import Ingress
from serve_app.ingress.rate_limits import RateLimiter
from serve_app.replica.deployment import ModelServer


def deployment(cls: type) -> Deployment:
    """The Serve deployment ``@serve.deployment`` made of ``cls`` (a type checker sees the class)."""
    return cast(Deployment, cls)


def build_app(args: dict[str, Any]) -> Application:
    config = parse_app_config(args)
    handles = {
        model.name: deployment(ModelServer)
        .options(name=model.deployment_name, **model.resolved_deployment(config.ingress.request_timeout_s))
        .bind(model)
        for model in config.models
    }
    limits = config.ingress.rate_limits
    rate_limiter = None
    if limits is not None:
        rate_limiter = deployment(RateLimiter).options(name="rate-limiter", **limits.deployment).bind(limits)
    return deployment(Ingress).options(**config.ingress.resolved_deployment()).bind(config, handles, rate_limiter)
