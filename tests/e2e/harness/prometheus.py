"""A real Prometheus server scraping the app's cluster, for the dashboard and alert tests.

The binary is Debian's ``prometheus`` package (``tools/install-servers``, which ``make
test`` runs, installs it; ``promtool`` ships with it). It scrapes Ray's metrics endpoint
every SCRAPE_INTERVAL_S and evaluates the rule files it is given as often.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml

from tests.e2e.harness.ray_cluster import free_port
from tests.waiting import wait_until_blocking

# Each scrape waits this long for Ray's metrics page (Prometheus's timeout is its interval). The
# suite's page is about 3 MB; on a loaded machine Ray's agent took over 1 s to serve it, and at a
# 1 s interval every scrape of a whole minute failed (a clean-clone run of cc19635). Each scrape
# also costs the agent a rendering of the page.
SCRAPE_INTERVAL_S = 3


def prometheus_binary(name: str = "prometheus") -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: run tools/install-servers (Debian's prometheus package)")
    return path


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, metrics_url: str, workdir: Path, rule_files: Sequence[Path] = ()) -> Prometheus:
        target = urlparse(metrics_url)
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": "ray",
                    "metrics_path": target.path or "/metrics",
                    "static_configs": [{"targets": [target.netloc]}],
                }
            ],
        }
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        process = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(workdir / "prometheus.log").open("wb"),
        )
        server = cls(f"http://127.0.0.1:{port}", process)
        server.wait_ready(within_s=60)
        return server

    def wait_ready(self, within_s: float) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}")
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until_blocking(ready, within_s, "prometheus ready")

    def api(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's series (``metric`` labels and ``value``), now or ``at`` (Unix seconds)."""
        data = self.api("query", query=expr, **({} if at is None else {"time": at}))
        assert data["resultType"] == "vector", data
        return data["result"]

    def last_scrape_at(self) -> float:
        """When Prometheus last scraped the cluster (Unix seconds), from its ``up`` series."""
        scraped = self.query('timestamp(up{job="ray"})')
        return float(scraped[0]["value"][1]) if scraped else 0.0  # not scraped yet

    def last_good_scrape_at(self) -> float | None:
        """When Prometheus last scraped the cluster and got an answer; None if the last scrape failed.

        A scrape that fails (Ray's agent, on a loaded machine, past the timeout) marks every
        series of the target stale: an instant query then finds none of them until the next scrape
        succeeds. Queries evaluated at this time see what the last good scrape read."""
        scraped = self.query('timestamp(up{job="ray"} == 1)')
        return float(scraped[0]["value"][1]) if scraped else None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
