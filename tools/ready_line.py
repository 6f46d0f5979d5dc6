"""One line when a locally started app can answer: its URL, its models, how to stop it.

`make serve` runs this next to ``serve run``. Serve's own output does not say
when the models can answer: ``/v1/models`` lists the configured models as soon
as the ingress runs, a minute or more before an engine has loaded. ``/health``
is the readiness signal (200 once every model has a running replica), so this
waits for it, then prints::

    ready: http://127.0.0.1:8000/v1 serves glm-4-9b-chat; stored responses live in the model
    replica's memory (Ctrl-C stops it)

(one line; "in Redis" where the config keeps them there).

A config of several applications gets one such line each, once all of them answer.

Usage: ``python -m tools.ready_line deploy/config.cpu.yaml``. It gives up
when the shell that started it ends (``serve run`` stopped) or after
``--timeout-s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

POLL_S = 1.0


@dataclass(frozen=True)
class LocalApp:
    base_url: str  # scheme, host, port and route prefix: ``/health`` and ``/v1`` hang below it
    models: tuple[str, ...]
    responses_in_redis: bool = False  # ingress.responses_store.redis is set

    def line(self) -> str:
        where = "in Redis" if self.responses_in_redis else "in the model replica's memory"
        served = f"{self.base_url}/v1 serves {', '.join(self.models)}"
        return f"ready: {served}; stored responses live {where} (Ctrl-C stops it)"


def local_apps(config: dict[str, Any]) -> list[LocalApp]:
    """Where each of a serve config's applications answers, and the models it serves (the config is the one source)."""
    http = config.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    apps = []
    for application in config["applications"]:
        prefix = (application.get("route_prefix") or "/").rstrip("/")
        models = tuple(model["name"] for model in application["args"]["models"])
        store = (application["args"].get("ingress") or {}).get("responses_store") or {}
        apps.append(LocalApp(f"http://{host}:{http.get('port', 8000)}{prefix}", models, store.get("redis") is not None))
    return apps


def wait_until_ready(app: LocalApp, timeout_s: float, parent_pid: int | None = None) -> bool:
    """True once ``/health`` answers 200; False on timeout or when the parent process is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (parent_pid is None or os.getppid() == parent_pid):
        try:
            with urllib.request.urlopen(f"{app.base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 until a model serves
            pass
        time.sleep(POLL_S)  # poll interval of the condition above
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="the serve config `serve run` was given")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    apps = local_apps(yaml.safe_load(args.config.read_text()))
    deadline = time.monotonic() + args.timeout_s
    for app in apps:
        if not wait_until_ready(app, deadline - time.monotonic(), parent_pid=os.getppid()):
            return 1
    print("\n".join(app.line() for app in apps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
