"""The production overlay's Redis sets, run on this machine: the GCS's (k8s/overlays/production/redis.yaml)
or the Responses API store's (responses-store.yaml), which its scripts run with an environment of its own.

Each of its pods is a Redis and a Sentinel started by the scripts its ConfigMap ships, with the
environment its StatefulSet gives them; here every pod is two processes on 127.0.0.1, told
apart by their ports instead of by DNS names. Debian's ``redis-server`` runs both
(``tools/install-servers``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.harness.ray_cluster import free_port
from tests.repo.k8s_manifests import documents

GCS_SET, RESPONSES_SET = "glm4-serve-redis", "glm4-serve-responses-store"
AS_SHIPPED = ("MASTER_NAME", "MAXMEMORY")  # the environment values that hold here as they are


def shipped_set(name: str) -> tuple[dict[str, str], dict[str, str], int]:
    """The ConfigMap's scripts, the Redis container's plain environment values, and the set's size."""
    docs = documents("production")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == GCS_SET]
    (stateful_set,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == name]
    (redis,) = [c for c in stateful_set["spec"]["template"]["spec"]["containers"] if c["name"] == "redis"]
    env = {e["name"]: e["value"] for e in redis["env"] if "value" in e}
    return config_map["data"], env, stateful_set["spec"]["replicas"]


@dataclass
class RedisPod:
    """One pod of the set: its Redis and its Sentinel, on ports of their own."""

    index: int
    redis_port: int = field(default_factory=free_port)
    sentinel_port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)


@dataclass
class RedisSet:
    """The set's pods, started and stopped as Kubernetes would: by their scripts, with a password file."""

    root: Path
    name: str = GCS_SET
    password: str = "not-the-production-secret"
    pods: list[RedisPod] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scripts, self.shipped_env, replicas = shipped_set(self.name)
        (self.root / "scripts").mkdir(parents=True)
        for name, text in self.scripts.items():
            (self.root / "scripts" / name).write_text(text)
        self.password_file = self.root / "password"
        self.password_file.write_text(self.password)
        self.password_file.chmod(0o600)
        self.pods = [RedisPod(i) for i in range(replicas)]

    @property
    def monitored(self) -> str:
        """The name the Sentinels know the primary by (the StatefulSet's MASTER_NAME)."""
        return self.shipped_env["MASTER_NAME"]

    @property
    def sentinels(self) -> list[str]:
        return [f"127.0.0.1:{pod.sentinel_port}" for pod in self.pods]

    def env(self, pod: RedisPod) -> dict[str, str]:
        """The StatefulSet's environment, with this machine's names and ports for the pod's DNS name."""
        pod_dir = self.root / f"pod-{pod.index}"
        for sub in ("data", "tmp"):
            (pod_dir / sub).mkdir(parents=True, exist_ok=True)
        seed = self.pods[0]
        here = {name: self.shipped_env[name] for name in AS_SHIPPED if name in self.shipped_env} | {
            "REDIS_HOST": "127.0.0.1",
            "REDIS_PORT": str(pod.redis_port),
            "SENTINEL_PORT": str(pod.sentinel_port),
            "SEED_HOST": "127.0.0.1",
            "SEED_PORT": str(seed.redis_port),
            "SENTINELS": " ".join(self.sentinels),
            "REDIS_PASSWORD_FILE": str(self.password_file),
            "SCRIPTS": str(self.root / "scripts"),
            "DATA_DIR": str(pod_dir / "data"),
            "CONF_DIR": str(pod_dir / "tmp"),
        }
        assert here.keys() == self.shipped_env.keys(), "the StatefulSet's environment changed: map it here"
        return {"PATH": os.environ["PATH"]} | here

    def start(self, pod: RedisPod, container: str) -> None:
        """Start one container of ``pod`` (``redis`` or ``sentinel``) with its script."""
        log = (self.root / f"pod-{pod.index}-{container}.log").open("a")
        pod.processes[container] = subprocess.Popen(
            ["sh", str(self.root / "scripts" / f"{container}.sh")],
            env=self.env(pod),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, pod: RedisPod, container: str) -> None:
        """As a node's loss ends it: SIGKILL, no shutdown."""
        process = pod.processes.pop(container)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self) -> None:
        for pod in self.pods:
            for container in list(pod.processes):
                self.kill(pod, container)
        shutil.rmtree(self.root, ignore_errors=True)

    def ask(self, port: int, *command: str) -> list[str]:
        """``redis-cli``'s raw answer lines from the server on ``port`` (none if it does not answer)."""
        answer = subprocess.run(
            ["redis-cli", "-p", str(port), "--raw", *command],
            env={"PATH": os.environ["PATH"], "REDISCLI_AUTH": self.password},
            capture_output=True,
            text=True,
            timeout=10,
        )
        return answer.stdout.split() if answer.returncode == 0 else []

    def primary_named_by(self, pod: RedisPod) -> int | None:
        """The primary's port as ``pod``'s Sentinel names it."""
        answer = self.ask(pod.sentinel_port, "SENTINEL", "get-master-addr-by-name", self.monitored)
        return int(answer[1]) if len(answer) == 2 and answer[1].isdigit() else None

    def start_all(self) -> None:
        for pod in self.pods:
            self.start(pod, "redis")
            self.start(pod, "sentinel")

    def set_up(self) -> bool:
        """Every Sentinel watches pod 0's Redis as the primary, its replicas and the other Sentinels."""
        first, *others = self.pods
        expected = f"address=127.0.0.1:{first.redis_port},slaves={len(others)},sentinels={len(self.pods)}"
        watching = [self.ask(pod.sentinel_port, "INFO", "sentinel") for pod in self.pods]
        return all(any(expected in line for line in lines) for lines in watching)

    def promoted(self, lost: RedisPod) -> int | None:
        """The port of the primary the other pods' Sentinels name in place of ``lost``'s, once they do."""
        named = {self.primary_named_by(pod) for pod in self.pods if pod is not lost}
        return next((port for port in named if port not in (None, lost.redis_port)), None)

    def role(self, pod: RedisPod) -> dict[str, str]:
        """``INFO replication`` of ``pod``'s Redis."""
        lines = self.ask(pod.redis_port, "INFO", "replication")
        return dict(line.split(":", 1) for line in lines if ":" in line)
