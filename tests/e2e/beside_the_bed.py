"""A variant of the bed deployed beside the suite's applications for one test module.

``test_relay_path.py`` proves the relay path on the ``direct`` variant's application (the bed
with a small queue) with ``ingress.direct_streaming`` false, under a name and route of its own.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.e2e.apps import RunningApp, application
from tests.e2e.serve_state import DeploymentName, running, serve_deploy, serve_deploy_settled
from tests.waiting import wait_until


def small_queue_variant(sim_app: RunningApp, name: str, route: str, direct_streaming: bool) -> dict[str, Any]:
    """The ``direct`` variant's application (its model replica taking TAKES requests at once and
    QUEUES more waiting) under another name and route, on the given data path."""
    app = copy.deepcopy(application(yaml.safe_load(sim_app.config_path.read_text()), "direct"))
    app["name"], app["route_prefix"] = name, route
    app["args"]["ingress"]["direct_streaming"] = direct_streaming
    return app


@asynccontextmanager
async def deployed_beside_the_bed(
    sim_app: RunningApp, cluster: str, directory: Path, variant: dict[str, Any], deployments: list[DeploymentName]
) -> AsyncIterator[RunningApp]:
    """``variant`` (see :func:`small_queue_variant`) deployed beside the suite's applications until
    the block ends, once each of ``deployments`` runs a replica and it answers ``/health``; then
    the suite's config again."""
    config = yaml.safe_load(sim_app.config_path.read_text())
    config["applications"].append(variant)
    path = directory / f"with-{variant['name']}-app.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        await serve_deploy(path, cluster)
        for deployment in deployments:
            await wait_until(partial(running, deployment, 1), 120, f"{deployment.deployment_name} running")
        app = RunningApp(
            variant["name"],
            sim_app.origin,
            variant["route_prefix"],
            sim_app.grpc_target,
            sim_app.model,
            sim_app.model_path,
            sim_app.log_path,
            path,
        )
        await wait_until(lambda: _healthy(app), 60, f"the {app.name} app answering /health")
        yield app
    finally:
        await serve_deploy_settled(sim_app.config_path, cluster)  # the variant goes


async def _healthy(app: RunningApp) -> bool:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{app.url}/health")).status_code == 200
