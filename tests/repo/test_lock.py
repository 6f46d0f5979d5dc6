"""The GPU image's dependencies are locked with hashes, and the lock agrees with pyproject.toml.

requirements/gpu.lock is written by `make lock` (uv, pinned in pyproject's `lock` group) and
installed by the Dockerfile with --require-hashes. Resolving needs the package registry, so the
tests do not resolve again; they check what a stale or hand-edited lock would break.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "gpu.lock"


def locked() -> dict[str, tuple[str, list[str]]]:
    """Package name -> (pinned version, its sha256 hashes), read from the lock's entries."""
    entries: dict[str, tuple[str, list[str]]] = {}
    text = re.sub(r"\\\n\s*", " ", LOCK.read_text())
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split(" --hash=")
        assert not requirement.startswith("-"), f"only pinned requirements belong in the lock: {line[:80]}"
        name, version = requirement.strip().split("==")
        entries[canonicalize_name(name)] = (version, [h.strip() for h in options])
    return entries


def image_requirements() -> list[Requirement]:
    """What the image installs: the project's dependencies and its `gpu` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]]


def test_every_locked_package_is_pinned_with_hashes():
    entries = locked()
    assert len(entries) > 100  # vLLM's CUDA build and Ray bring a couple of hundred
    for name, (version, hashes) in entries.items():
        assert re.fullmatch(r"[\w.+!-]+", version), name
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_the_lock_holds_exactly_the_versions_pyproject_pins():
    entries = locked()
    for requirement in image_requirements():
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{requirement}: pyproject pins exactly"
        name = canonicalize_name(requirement.name)
        assert name in entries, f"{name} is not in the lock: run `make lock`"
        assert entries[name][0] == specifier.version, f"{name}: lock has {entries[name][0]}; run `make lock`"


def test_the_lock_names_no_package_index():
    """The registry is the builder's choice (pip's configuration), never written into the repository."""
    assert not re.search(r"--(extra-)?index-url|--find-links|://", LOCK.read_text())


def test_the_image_installs_the_lock_with_hashes_and_resolves_nothing_else():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install --no-cache-dir --require-hashes -r requirements/gpu.lock" in dockerfile
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert all("--require-hashes" in line or "--no-deps" in line for line in installs), installs
