"""The serve config the end-to-end suite runs (tests/e2e/harness/apps.py) is one Serve accepts,
each deployment's options and each application's arguments included: a mistake in a variant fails
here in seconds, not as a suite that waits its start's bound for an application that never comes up."""

from __future__ import annotations

from pathlib import Path

from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from serve_app.config import parse_app_config
from serve_app.deployments.options import model_server_options
from tests.e2e.harness.apps import suite_config


def test_every_application_of_the_suite_is_one_serve_and_the_app_accept(tmp_path: Path) -> None:
    config = suite_config(8000, 9000, {}, tmp_path)
    ServeDeploySchema.model_validate(config)
    for application in config["applications"]:
        app_config = parse_app_config(application["args"])
        (model,) = app_config.models
        options = model_server_options(model, app_config.ingress.request_timeout_s, app_config.ingress.open_calls)
        if "autoscaling_config" in options:
            AutoscalingConfig(**options["autoscaling_config"])
