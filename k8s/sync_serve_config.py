"""Copy deploy/config.yaml into the RayService's serveConfigV2, verbatim.

The serve config has one source of truth, deploy/config.yaml; the RayService carries a
copy because KubeRay reads serveConfigV2 as a string inside the manifest. Run
`make k8s-sync` after editing the serve config; tests/unit/test_k8s.py fails while the
copy differs.

    python k8s/sync_serve_config.py          # rewrite the block in place
    python k8s/sync_serve_config.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "deploy" / "config.yaml"
RAYSERVICE = ROOT / "k8s" / "base" / "rayservice.yaml"
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


def main(argv: list[str]) -> int:
    current = RAYSERVICE.read_text()
    synced = with_serve_config(current, SERVE_CONFIG.read_text())
    if "--check" in argv:
        if synced != current:
            print(f"{RAYSERVICE.relative_to(ROOT)} is out of date: run `make k8s-sync`", file=sys.stderr)
            return 1
        return 0
    RAYSERVICE.write_text(synced)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
