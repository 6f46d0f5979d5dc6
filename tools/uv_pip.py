"""``uv pip`` with the package sources pip is configured with: ``make`` installs the environments with it.

uv resolves and installs in parallel (the app's environment: 32 s from a cold cache, where pip took 155 s in a
clean-clone ``.ci/run``; docs/testing.md), but it reads none of pip's configuration, and a machine
may point pip at its own indexes, wheel folders, constraints or certificate. This asks the pip of
the Python that runs it for its settings (``pip config list``: files, then ``PIP_*`` variables) and
hands them to uv. The standard library only::

    python tools/uv_pip.py UV PYTHON install ...   # as `uv pip install --python PYTHON ...`
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def pip_settings() -> dict[str, str]:
    """pip's settings as ``pip config list`` prints them, by name; a later source overrides an earlier."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    settings = {}
    for line in listed.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            settings[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    return settings


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's options and environment for pip's ``settings``. pip takes the best version any index
    offers; uv, by default, only the first index's that has the package: ``unsafe-best-match`` is pip's way."""
    options = ["--index-strategy", "unsafe-best-match"]
    if "index-url" in settings:
        options += ["--index-url", settings["index-url"]]
    listed = (("extra-index-url", "--extra-index-url"), ("find-links", "--find-links"), ("constraint", "--constraints"))
    for name, option in listed:
        for value in settings.get(name, "").split():
            options += [option, value]
    env = {}
    if "cert" in settings:
        env["SSL_CERT_FILE"] = settings["cert"]
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout:
        env["UV_HTTP_TIMEOUT"] = timeout
    return options, env


def main(argv: Sequence[str]) -> int:
    uv, python, command, *rest = argv
    options, env = uv_options(pip_settings())
    return subprocess.call([uv, "pip", command, "--python", python, *options, *rest], env=os.environ | env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
