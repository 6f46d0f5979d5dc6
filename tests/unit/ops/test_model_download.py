"""The weights Job downloads what the serve config serves, at the revisions it names."""

from __future__ import annotations

from pathlib import Path

import yaml

from serve_app.ops.model_download import Checkpoint, checkpoints, download_all

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def config_with(engine_args: dict) -> dict:
    model = {"name": "m", "engine_args": {"max_num_seqs": 8} | engine_args}
    return {"applications": [{"import_path": "serve_app.app:build_app", "args": {"models": [model]}}]}


def test_production_downloads_its_checkpoint():
    for name in ("config.yaml", "config.single-gpu.yaml", "config.fp8.yaml"):
        config = yaml.safe_load((DEPLOY / name).read_text())
        assert checkpoints(config) == [Checkpoint("THUDM/glm-4-9b-chat-hf", None)]


def test_the_4_bit_variant_serves_a_local_checkpoint_the_download_leaves_alone():
    """Its checkpoint is written from the -hf one by serve_app/ops/quantise_w4a16.py, not downloaded."""
    config = yaml.safe_load((DEPLOY / "config.w4a16.yaml").read_text())
    assert checkpoints(config) == []


def test_revisions_and_a_separate_tokenizer_are_downloaded_as_named():
    commit = "a" * 40
    config = config_with(
        {"model": "org/weights", "revision": commit, "tokenizer": "org/tok", "tokenizer_revision": "v1"}
    )
    assert checkpoints(config) == [Checkpoint("org/weights", commit), Checkpoint("org/tok", "v1")]


def test_local_directories_and_other_applications_are_left_alone(tmp_path):
    assert checkpoints(config_with({"model": str(tmp_path)})) == []
    assert checkpoints(config_with({"model": "/models/glm"})) == []
    other = {
        "applications": [{"import_path": "elsewhere:app", "args": {"models": [{"engine_args": {"model": "x/y"}}]}}]
    }
    assert checkpoints(other) == []


def test_each_checkpoint_is_handed_to_the_downloader_once():
    calls = []

    def download(repo_id: str, revision: str | None) -> str:
        calls.append((repo_id, revision))
        return f"/cache/{repo_id}"

    config = config_with({"model": "org/w", "tokenizer": "org/w"})
    assert download_all(checkpoints(config), download) == ["/cache/org/w"]
    assert calls == [("org/w", None)]


def test_waiting_polls_the_local_cache_until_every_checkpoint_is_there():
    from serve_app.ops.model_download import wait_for

    present: set[str] = set()
    asked: list[tuple[str, bool]] = []

    def cache(repo_id: str, revision: str | None, local_files_only: bool = False) -> str:
        asked.append((repo_id, local_files_only))
        if repo_id not in present:
            present.add(repo_id)  # the Job finishes this one before the next look
            raise FileNotFoundError(repo_id)
        return f"/cache/{repo_id}"

    wait_for([Checkpoint("org/a", None), Checkpoint("org/b", None)], cache, poll_s=0)
    assert all(local for _, local in asked)  # never the network
    assert asked == [("org/a", True), ("org/b", True), ("org/a", True), ("org/b", True)]


def test_waiting_finds_a_checkpoint_in_a_real_hub_cache(tmp_path, monkeypatch):
    """huggingface_hub's own cache layout and lookup, offline: absent, then present."""
    import huggingface_hub

    from serve_app.ops.model_download import missing

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_dir = tmp_path / "hub"
    wanted = [Checkpoint("org/model", None)]

    def lookup(**kwargs):
        return huggingface_hub.snapshot_download(cache_dir=cache_dir, **kwargs)

    assert missing(wanted, lookup) == wanted
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache_dir / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    assert missing(wanted, lookup) == []
