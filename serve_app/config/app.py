"""Application configuration: the validated shape of a serve config's ``args``.

``serve run deploy/config.yaml`` hands the ``args`` mapping of the application to
:func:`serve_app.app.build_app`, which validates it here before anything starts.
A mistake (an unknown engine argument, a negative replica count, two models with
one name) fails at start with a message naming the field, not minutes later
inside a replica. Deployment options are checked with Ray Serve's own
``DeploymentSchema`` and engine arguments against vLLM's own argument classes, so
both keep vLLM's and Ray's names and meanings.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import StrictModel
from serve_app.config.ingress import IngressConfig
from serve_app.config.models import ModelConfig


class AppConfig(StrictModel):
    """The whole application: the models it serves and its ingress."""

    models: list[ModelConfig] = Field(
        min_length=1, description="The models served, at least one; each is its own deployment, model-<name>."
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @field_validator("models")
    @classmethod
    def _names_are_unique(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        return models

    @model_validator(mode="after")
    def _one_model(self) -> AppConfig:
        if len(self.models) != 1:
            raise ValueError(
                f"models lists {len(self.models)}: an application serves exactly one model (its replicas "
                "answer clients themselves); give each model its own application"
            )
        return self

    @model_validator(mode="after")
    def _a_request_fits_in_a_batch(self) -> AppConfig:
        limit = self.ingress.max_sequences_per_request
        for i, model in enumerate(self.models):
            batch = model.engine_args.get("max_num_seqs")
            if isinstance(batch, int) and limit > batch:
                raise ValueError(
                    f"ingress.max_sequences_per_request ({limit}) is above models.{i}.engine_args.max_num_seqs "
                    f"({batch}): one request could ask for more sequences than a replica runs at once"
                )
        return self

    @model_validator(mode="after")
    def _fair_share_schedules_by_priority(self) -> AppConfig:
        if not self.ingress.applies_fair_share:
            return self
        for i, model in enumerate(self.models):
            policy = model.engine_args.get("scheduling_policy", "priority")
            if policy != "priority":
                raise ValueError(
                    f"models.{i}.engine_args.scheduling_policy is {policy!r}: ingress.fair_share schedules "
                    "waiting requests by priority; remove it, or set ingress.fair_share: false"
                )
        return self

    @model_validator(mode="after")
    def _limits_have_keys(self) -> AppConfig:
        if self.ingress.rate_limits is not None and self.ingress.api_keys is None:
            raise ValueError("ingress.rate_limits are per API key: set ingress.api_keys too")
        return self

    @model_validator(mode="after")
    def _stalls_are_caught_before_requests_time_out(self) -> AppConfig:
        limit = self.ingress.request_timeout_s
        for i, model in enumerate(self.models):
            if model.engine_stall_timeout_s >= limit:
                raise ValueError(
                    f"models.{i}.engine_stall_timeout_s ({model.engine_stall_timeout_s:g}) is not below "
                    f"ingress.request_timeout_s ({limit:g}): every request would time out before a hung "
                    "engine is noticed"
                )
        return self

    @model_validator(mode="after")
    def _drain_outlasts_answers(self) -> AppConfig:
        limit = self.ingress.request_timeout_s
        deployments = {f"models.{i}": m.deployment for i, m in enumerate(self.models)}
        for where, options in deployments.items():
            drain = options.get("graceful_shutdown_timeout_s")
            if drain is not None and drain < limit:
                raise ValueError(
                    f"{where}.deployment.graceful_shutdown_timeout_s ({drain:g}) is shorter than "
                    f"ingress.request_timeout_s ({limit:g}): a replica removed by downscaling or a "
                    "config change would cut answers that are still allowed to run"
                )
        return self

    @model_validator(mode="after")
    def _one_replica_per_in_process_store(self) -> AppConfig:
        if self.ingress.responses_store.redis is not None:
            return self
        for i, model in enumerate(self.models):
            options = model.deployment
            most = (options.get("autoscaling_config") or {}).get("max_replicas", options.get("num_replicas", 1))
            if most == "auto" or (isinstance(most, int) and most > 1):
                raise ValueError(
                    f"models.{i}.deployment may run {most} replicas, but stored responses are kept in each "
                    "replica's memory: a GET or a previous_response_id could reach a replica that holds nothing; "
                    'set ingress.responses_store.redis (docs/api-behaviour.md, "Where answers live")'
                )
        return self


class ConfigError(ValueError):
    """The serve config's application arguments are invalid."""


def parse_app_config(args: dict[str, Any]) -> AppConfig:
    """Validate application arguments, raising :class:`ConfigError` that names each bad field."""
    from pydantic import ValidationError

    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(top level)"
            problems.append(f"  args.{where}: {error['msg']}")
        raise ConfigError("invalid application arguments:\n" + "\n".join(problems)) from None
