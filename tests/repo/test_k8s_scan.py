"""A security scanner over the Kubernetes manifests: checkov, on the base and every overlay as rendered.

checkov does not look inside a custom resource, so each RayService's head and worker pod
templates are written out as Pods, which is what KubeRay makes of them; the other objects
(NetworkPolicy, PodDisruptionBudget, PVC) are scanned as they are. No check may fail except
those in k8s/checkov-accepted.yaml, each with a one-line reason, and every entry there must
still fail somewhere (an entry that no longer fails is removed, not kept "just in case").
checkov runs from its own environment (.venv-scan, made by `make test`), offline.
"""

from __future__ import annotations

import fcntl
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.repo.k8s_manifests import K8S, OVERLAYS, ROOT, kubectl, pod_templates

CHECKOV = ROOT / ".venv-scan" / "bin" / "checkov"
ACCEPTED = K8S / "checkov-accepted.yaml"
SCANNED = {"base": K8S / "base", **{overlay: K8S / "overlays" / overlay for overlay in OVERLAYS}}


def as_scanned(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects checkov reads: each RayService's pod templates as Pods, the rest unchanged."""
    scanned = []
    for document in documents:
        if document["kind"] != "RayService":
            scanned.append(document)
            continue
        for index, template in enumerate(pod_templates(document)):
            name = f"{document['metadata']['name']}-{'head' if index == 0 else f'worker-{index}'}"
            metadata = template.get("metadata", {}) | {"name": name, "namespace": document["metadata"]["namespace"]}
            scanned.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
    return scanned


@functools.cache
def failed_checks(tmp: Path) -> dict[str, set[str]]:
    """checkov's failed checks over every rendered set: check id -> ``set/resource`` names."""
    for name, path in SCANNED.items():
        out = subprocess.run([kubectl(), "kustomize", str(path)], check=True, capture_output=True, text=True).stdout
        documents = [d for d in yaml.safe_load_all(out) if d]
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump_all(as_scanned(documents), sort_keys=False))
    assert CHECKOV.exists(), f"{CHECKOV} not found: `make test` (or `make .venv-scan/.installed`) installs it"
    scan = subprocess.run(
        [str(CHECKOV), "--directory", str(tmp), "--framework", "kubernetes", "--skip-download", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert scan.returncode in (0, 1), scan.stderr[-2000:]  # 1: some check failed
    reports = json.loads(scan.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed: dict[str, set[str]] = {}
    for report in reports:
        assert report["summary"]["passed"] > 0 and report["summary"]["parsing_errors"] == 0, report["summary"]
        for check in report["results"]["failed_checks"]:
            failed.setdefault(check["check_id"], set()).add(f"{Path(check['file_path']).stem}/{check['resource']}")
    return failed


@pytest.fixture(scope="module")
def failed(tmp_path_factory, worker_id: str) -> dict[str, set[str]]:
    """The scan, once per test run: it is the module's cost (about a minute of CPU), and under
    xdist each worker that runs one of its tests would scan again. Workers share the run's base
    directory; the first to take its lock scans and writes the result there (xdist's own recipe)."""
    if worker_id == "master":  # no xdist: this process is the run
        return failed_checks(tmp_path_factory.mktemp("checkov"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's, above each worker's own
    with (shared / "checkov.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = shared / "checkov-failed.json"
        if not result.exists():
            found = failed_checks(tmp_path_factory.mktemp("checkov"))
            result.write_text(json.dumps({check: sorted(names) for check, names in found.items()}))
        return {check: set(names) for check, names in json.loads(result.read_text()).items()}


def accepted() -> dict[str, str]:
    return yaml.safe_load(ACCEPTED.read_text())


def test_every_accepted_failure_says_why_in_one_line():
    for check, reason in accepted().items():
        assert check.startswith("CKV"), check
        assert isinstance(reason, str) and reason.strip() and "\n" not in reason, check


def test_no_check_fails_but_the_accepted_ones(failed):
    unexpected = {check: sorted(where) for check, where in failed.items() if check not in accepted()}
    assert unexpected == {}


def test_every_accepted_failure_still_fails(failed):
    """An accepted check that passes everywhere now is taken off the list."""
    assert sorted(set(accepted()) - set(failed)) == []


def test_the_scan_sees_every_rendered_set_and_every_pod_template(failed):
    """The probes' checks fail on every set's head and worker (CPU, GPU) Pods: proof each was scanned."""
    pods = ("head", "worker-1", "worker-2")
    assert failed["CKV_K8S_8"] == {f"{name}/Pod.glm4-serve.glm4-serve-{pod}" for name in SCANNED for pod in pods}


def test_a_released_overlay_names_every_image_by_digest(tmp_path):
    """The release step pins images as `kustomize edit set image NAME=REPO@sha256:...` writes them
    (newName and digest in the overlay's `images`); rendered so, no container fails checkov's
    digest check (CKV_K8S_43), the one accepted for the checked-in, tagged overlays."""
    import shutil

    shutil.copytree(K8S, tmp_path / "k8s")
    kustomization = tmp_path / "k8s" / "overlays" / "production" / "kustomization.yaml"
    config = yaml.safe_load(kustomization.read_text())
    for index, image in enumerate(config["images"]):
        image.pop("newTag")
        image |= {"newName": f"images.internal/{image['name']}", "digest": f"sha256:{index:064x}"}
    kustomization.write_text(yaml.safe_dump(config, sort_keys=False))
    scanned = tmp_path / "scanned"
    scanned.mkdir()
    for overlay in ("production", "production-incremental"):
        out = subprocess.run(
            [kubectl(), "kustomize", str(tmp_path / "k8s" / "overlays" / overlay)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        documents = [d for d in yaml.safe_load_all(out) if d]
        (scanned / f"{overlay}.yaml").write_text(yaml.safe_dump_all(as_scanned(documents), sort_keys=False))
        assert "@sha256:" in out and ":0.1.0" not in out
    scan = subprocess.run(
        [str(CHECKOV), "--directory", str(scanned), "--framework", "kubernetes", "--skip-download"]
        + ["--check", "CKV_K8S_43", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(scan.stdout)
    assert report["summary"]["failed"] == 0 and report["summary"]["passed"] >= 8, report["summary"]
