"""The application arguments of the serve configs under deploy/, and the smallest valid ones."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SHIPPED = [
    "config.yaml",
    "config.single-gpu.yaml",
    "config.fp8.yaml",
    "config.w4a16.yaml",
    "config.cpu.yaml",
    "config.sim.yaml",
]


def app_args(config_file: str) -> dict:
    return yaml.safe_load((DEPLOY / config_file).read_text())["applications"][0]["args"]


def minimal(**model_overrides) -> dict:
    model = {"name": "glm-4-9b-chat", "engine_args": {"model": "some/path", "max_num_seqs": 8}} | model_overrides
    return {"models": [model]}
