"""Ray Serve LLM's direct streaming on the simulated engine: a side for ``benchmarks.serving_overhead``.

Ray Serve LLM (``ray.serve.llm:build_openai_app``) is started as its documentation
starts it, with ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` and Serve's HAProxy (the
cluster settings of ``deploy/cluster.env``): its ``LLMServer`` replica serves the HTTP
response itself and its ``LLMRouter`` only picks the replica. Its engine is the same
simulated engine this app's benchmarks use: a Ray worker-process setup hook
(:func:`simulate_engine`, named in the replica's ``runtime_env`` as
``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``; Ray ignores a deployment's own
``worker_process_setup_hook``) makes every vLLM ``AsyncLLM`` of the replica's process
generate with :mod:`serve_app.simulated_engine`. One replica, the model's engine
arguments, no API keys: what differs from this app's side is the serving layer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.servers import ServerCommand, app_entry, free_port
from serve_app.config import sized_for
from tools.cluster_env import cluster_env

SETTINGS_ENV = "GLM4_BENCH_SIMULATED_ENGINE"  # the simulated engine's settings, JSON
HOOK = "benchmarks.ray_serve_llm.simulate_engine"
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray's own: what a worker runs at start


def simulate_engine() -> None:
    """Ray worker setup hook: every ``AsyncLLM`` this process builds generates with the simulated engine."""
    from serve_app import vllm_internals
    from serve_app.config import SimulatedEngineConfig
    from serve_app.simulated_engine.core import simulated_core_factory

    settings = SimulatedEngineConfig.model_validate(json.loads(os.environ.get(SETTINGS_ENV) or "{}"))
    vllm_internals.replace_engine_core(simulated_core_factory(settings))


def llm_config(entry: dict[str, Any], cwd: Path) -> dict[str, Any]:
    """Ray Serve LLM's ``LLMConfig`` for a serve config's model entry, on one CPU bundle."""
    from serve_app.config import split_engine_args

    engine_kwargs, _ = split_engine_args(dict(entry["engine_args"]))  # its own front end takes none of ours
    engine_kwargs.pop("disable_log_stats", None)  # it logs the engine's metrics by default (as this app does)
    model_path = str((cwd / engine_kwargs.pop("model")).resolve())
    return {
        "model_loading_config": {"model_id": entry["name"], "model_source": model_path},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {"num_replicas": 1, "max_ongoing_requests": engine_kwargs["max_num_seqs"]},
        "placement_group_config": {"bundles": [{"CPU": 0.1}]},
        "runtime_env": {
            "env_vars": {
                SETUP_HOOK_ENV: HOOK,
                SETTINGS_ENV: json.dumps(
                    sized_for(entry.get("simulated_engine") or {}, entry["engine_args"]) | {"load_s": 0}
                ),
                "PYTHONPATH": str(cwd),  # the hook's module, in the replica's worker
            }
        },
    }


def ray_serve_llm_direct(config: dict[str, Any], model: str | None, workdir: Path, cwd: Path) -> ServerCommand:
    """``serve run`` of Ray Serve LLM's OpenAI app with direct streaming, on the model's simulated engine."""
    _, entry = app_entry(config, model)
    port = free_port()
    serve_config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "ray-serve-llm",
                "route_prefix": "/",
                "import_path": "ray.serve.llm:build_openai_app",
                "args": {"llm_configs": [llm_config(entry, cwd)]},
            }
        ],
    }
    path = workdir / "ray_serve_llm.yaml"
    path.write_text(yaml.safe_dump(serve_config, sort_keys=False))
    serve = Path(sys.executable).with_name("serve")
    env = cluster_env() | {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1"}
    return ServerCommand(
        "Ray Serve LLM, direct streaming",
        [str(serve), "run", str(path)],
        env,
        cwd,
        f"http://127.0.0.1:{port}",
        "/v1/models",
    )
