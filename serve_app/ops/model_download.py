"""Download the checkpoints a serve config serves into the Hugging Face cache, before replicas start.

On Kubernetes the Job glm4-serve-model-download runs this once into the model-cache volume
(`python -m serve_app.ops.model_download deploy/config.yaml`); model replicas then mount that
volume read-only and run with HF_HUB_OFFLINE=1, so they neither write to the cache nor need the
hub's token, and their pods wait for the Job's result first (`--wait`, an init container). The
cache is the hub's own layout (HF_HOME), which vLLM reads as it would after downloading itself.
The token, if a checkpoint is gated, is read from the file HF_TOKEN_PATH names (huggingface_hub's
own variable).

Runs in a Kubernetes Job and each worker pod's init container, never in a Serve replica.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve_app.config import parse_app_config

APP_IMPORT_PATH = "serve_app.app:build_app"


@dataclass(frozen=True)
class Checkpoint:
    """One repository of the hub at one revision (None: the repository's default branch)."""

    repo_id: str
    revision: str | None


def checkpoints(serve_config: dict[str, Any]) -> list[Checkpoint]:
    """Every hub checkpoint the serve config's models load: weights, and a separate tokenizer if any.

    A model given as a local directory is skipped: it is already where the replica reads it.
    """
    found: list[Checkpoint] = []
    for application in serve_config.get("applications", []):
        if application.get("import_path") != APP_IMPORT_PATH:
            continue
        for model in parse_app_config(application.get("args", {})).models:
            engine_args = model.engine_args
            wanted = [(engine_args["model"], engine_args.get("revision"))]
            if engine_args.get("tokenizer"):
                wanted.append((engine_args["tokenizer"], engine_args.get("tokenizer_revision")))
            for repo_id, revision in wanted:
                checkpoint = Checkpoint(repo_id, revision)
                if not Path(repo_id).is_absolute() and not Path(repo_id).exists() and checkpoint not in found:
                    found.append(checkpoint)
    return found


Downloader = Callable[..., str]


def download_all(found: list[Checkpoint], download: Downloader) -> list[str]:
    """Download each checkpoint (huggingface_hub's snapshot_download); return where each landed."""
    return [download(repo_id=c.repo_id, revision=c.revision) for c in found]


def missing(found: list[Checkpoint], download: Downloader) -> list[Checkpoint]:
    """The checkpoints not (yet) complete in the local cache, asked without the network."""
    absent = []
    for checkpoint in found:
        try:
            download(repo_id=checkpoint.repo_id, revision=checkpoint.revision, local_files_only=True)
        except Exception:  # huggingface_hub raises several kinds for "not in the cache"
            absent.append(checkpoint)
    return absent


def wait_for(found: list[Checkpoint], download: Downloader, poll_s: float = 10.0) -> None:
    """Return once every checkpoint is in the cache (the download Job has finished its work)."""
    while absent := missing(found, download):
        names = ", ".join(c.repo_id for c in absent)
        print(f"waiting for the model cache to hold {names} (the Job glm4-serve-model-download)", flush=True)
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("serve_config", type=Path, help="the serve config whose models to download")
    parser.add_argument("--wait", action="store_true", help="download nothing: wait until the cache holds them")
    args = parser.parse_args(argv)
    found = checkpoints(yaml.safe_load(args.serve_config.read_text()))
    from huggingface_hub import snapshot_download

    if args.wait:
        wait_for(found, snapshot_download)
        return 0
    for checkpoint, path in zip(found, download_all(found, snapshot_download), strict=True):
        print(f"{checkpoint.repo_id}@{checkpoint.revision or 'default branch'}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
