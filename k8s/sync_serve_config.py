"""Write the serve configs derived from deploy/config.yaml, and copy them into the manifests.

The serve config has one source of truth, deploy/config.yaml (production, two GPUs or more).
From it this writes:

- each variant's deploy/config.<variant>.yaml: deploy/config.yaml with the JSON-patch
  operations of deploy/config.<variant>.patch.yaml applied, for `serve run`:
  - single-gpu: one replica, no surge, for one GPU (and the single-gpu overlay);
  - fp8: FP8 weights and KV cache on H100s (and the fp8 overlay);
  - w4a16: 4-bit weights and an FP8 KV cache on 24 GB GPUs (A10G);
- the RayService's serveConfigV2 in k8s/base/rayservice.yaml: deploy/config.yaml verbatim
  (KubeRay reads the serve config as a string inside the manifest);
- k8s/overlays/<variant>/serve-config.yaml, for a variant with an overlay: a patch giving
  that overlay deploy/config.<variant>.yaml as its serveConfigV2.

Run `make k8s-sync` after editing deploy/config.yaml or a patch; tests/repo/test_k8s.py
fails while anything written here is out of date.

    python k8s/sync_serve_config.py          # rewrite in place
    python k8s/sync_serve_config.py --check  # exit 1 if something is out of date
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "deploy" / "config.yaml"
RAYSERVICE = ROOT / "k8s" / "base" / "rayservice.yaml"
# Each variant: what `serve run deploy/config.<variant>.yaml` needs, and whether an overlay of
# k8s/overlays carries it.
VARIANTS: dict[str, tuple[str, bool]] = {
    "single-gpu": ("one GPU machine, the `gpu` extra installed", True),
    "fp8": ("H100 GPUs, the `gpu` extra installed", True),
    "w4a16": ("24 GB GPUs (A10G), the `gpu` extra installed and the 4-bit checkpoint written", False),
}


def patch_file(variant: str) -> Path:
    return ROOT / "deploy" / f"config.{variant}.patch.yaml"


def config_file(variant: str) -> Path:
    return ROOT / "deploy" / f"config.{variant}.yaml"


def overlay_patch_file(variant: str) -> Path:
    return ROOT / "k8s" / "overlays" / variant / "serve-config.yaml"


KEY = "serveConfigV2: |"


def with_serve_config(manifest: str, serve_config: str) -> str:
    """The manifest text with the block under `serveConfigV2: |` replaced by serve_config.

    The block is every line after the key that is blank or indented deeper than the key;
    the new one is indented two spaces deeper, so YAML reads back exactly serve_config.
    """
    lines = manifest.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == KEY)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    pad = " " * (indent + 2)
    block = [pad + line if line.strip() else "\n" for line in serve_config.splitlines(keepends=True)]
    return "".join(lines[: start + 1] + block + lines[end:])


def patched(document: Any, operations: list[dict[str, Any]]) -> Any:
    """``document`` with JSON-patch (RFC 6902) ``replace``, ``add`` and ``remove`` operations applied.

    Paths are JSON pointers (``/applications/0/args/...``), as in kustomize's patches. A path
    that does not lead anywhere is an error: a patch never silently stops applying.
    """
    result = copy.deepcopy(document)
    for operation in operations:
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
        target = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        key: int | str = int(last) if isinstance(target, list) else last
        op = operation["op"]
        if op in ("replace", "remove") and (key not in target if isinstance(target, dict) else key >= len(target)):
            raise KeyError(f"{operation['path']}: nothing there to {op}")
        if op == "remove":
            del target[key]
        elif op in ("replace", "add"):
            target[key] = operation["value"]
        else:
            raise ValueError(f"{operation['path']}: unsupported operation {op!r}")
    return result


def variant_config(variant: str) -> str:
    """deploy/config.<variant>.yaml's text: deploy/config.yaml, patched, with a header saying so."""
    config = patched(yaml.safe_load(SERVE_CONFIG.read_text()), yaml.safe_load(patch_file(variant).read_text()))
    needs, overlay = VARIANTS[variant]
    header = (
        f"# Written by `make k8s-sync`: deploy/config.yaml with deploy/config.{variant}.patch.yaml\n"
        "# applied. Edit those two, not this; deploy/config.yaml says why each setting is what it is.\n"
        f"#   serve run deploy/config.{variant}.yaml     ({needs})\n"
        + (f"# The {variant} overlay's serveConfigV2 on Kubernetes.\n" if overlay else "")
    )
    return header + yaml.safe_dump(config, sort_keys=False, width=100)


def overlay_patch(serve_config: str, source: str) -> str:
    """A kustomize JSON patch that sets a RayService's serveConfigV2 to serve_config."""
    head = (
        f"# Written by `make k8s-sync`: {source} as this overlay's serveConfigV2.\n"
        "- op: replace\n  path: /spec/serveConfigV2\n  value: |\n"
    )
    return head + "".join("    " + line if line.strip() else "\n" for line in serve_config.splitlines(keepends=True))


def synced() -> dict[Path, str]:
    """Every file this writes, with the text it should have."""
    wanted = {RAYSERVICE: with_serve_config(RAYSERVICE.read_text(), SERVE_CONFIG.read_text())}
    for variant, (_, overlay) in VARIANTS.items():
        text = variant_config(variant)
        wanted[config_file(variant)] = text
        if overlay:
            wanted[overlay_patch_file(variant)] = overlay_patch(text, config_file(variant).relative_to(ROOT).as_posix())
    return wanted


def main(argv: list[str]) -> int:
    wanted = synced()
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run `make k8s-sync`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
