"""A Redis server of this machine's own, for a serve config whose stored responses live in Redis.

Debian's ``redis-server`` (``make servers`` installs it), on 127.0.0.1 with a password of its
own (auth on every port, as in production), no persistence, bounded memory as production's
store is (``noeviction``: Redis drops nothing; the app bounds what it keeps). :meth:`LocalRedis.env`
is what a serve config's ``ingress.responses_store.redis`` reads (deploy/config.sim.yaml). The
end-to-end suite starts one for its applications (tests/e2e/conftest.py); ``make serve`` one for a config that
names Redis, unless the environment already names one::

    python -m tools.local_redis start deploy/config.sim.yaml .venv/responses-redis  # prints the env
    python -m tools.local_redis stop .venv/responses-redis
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAXMEMORY = "256mb"
URL_ENV, PASSWORD_ENV = "RESPONSES_STORE_URL", "RESPONSES_STORE_PASSWORD"  # (RedisStoreConfig's defaults)
START_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalRedis:
    """One ``redis-server`` process; :meth:`start` returns once it answers."""

    root: Path
    port: int = field(default_factory=_free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    process: subprocess.Popen[bytes] | None = None
    daemon: bool = False  # outlives the process that started it (``make serve``): stopped by its pid file

    def env(
        self, url_env: str = "RESPONSES_STORE_URL", password_env: str = "RESPONSES_STORE_PASSWORD"
    ) -> dict[str, str]:
        """The environment a replica reads the store's address and password from."""
        return {url_env: f"redis://127.0.0.1:{self.port}/0", password_env: self.password}

    def start(self) -> LocalRedis:
        self.root = self.root.resolve()  # (a daemon changes to its `dir` before it opens its files)
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(
            f'port {self.port}\nbind 127.0.0.1\ndir {self.root}\nsave ""\nappendonly no\n'
            f"requirepass {self.password}\nmaxmemory {MAXMEMORY}\nmaxmemory-policy noeviction\n"
            + (
                f"daemonize yes\npidfile {self.root / 'redis.pid'}\nlogfile {self.root / 'redis.log'}\n"
                if self.daemon
                else ""
            )
        )
        log = (self.root / "redis.log").open("wb")
        self.process = subprocess.Popen(["redis-server", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.process.poll() not in (None, 0) or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.root / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)  # polled: redis-server says nothing when it is ready
        return self

    def _daemon_lines(self) -> str:
        return f"daemonize yes\npidfile {self.root / 'redis.pid'}\nlogfile {self.root / 'redis.log'}\n"

    def answers(self) -> bool:
        """Whether the server answers PING with its password."""
        import redis

        try:
            with redis.Redis(port=self.port, password=self.password, socket_timeout=1) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def stored_in_redis(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``ingress.responses_store.redis`` sections of a serve config's applications."""
    sections = []
    for application in config.get("applications") or []:
        store = ((application.get("args") or {}).get("ingress") or {}).get("responses_store") or {}
        if store.get("redis") is not None:
            sections.append(store["redis"])
    return sections


def start_for(config_path: Path, root: Path) -> int:
    """Start a Redis for the config if it names one its environment does not: its env lines on stdout."""
    from serve_app.config import RedisStoreConfig

    wanted = [
        RedisStoreConfig.model_validate(section) for section in stored_in_redis(yaml.safe_load(config_path.read_text()))
    ]
    missing = [redis for redis in wanted if not os.environ.get(redis.url_env)]
    if not missing:
        where = "Redis, as the environment names it" if wanted else "the model replica's memory"
        print(f"stored responses: in {where}", file=sys.stderr)
        return 0
    if shutil.which("redis-server") is None:
        names = ", ".join(sorted({redis.url_env for redis in missing}))
        print(
            f"{config_path} keeps stored responses in Redis: run `make servers` (Debian's redis-server) or set {names}",
            file=sys.stderr,
        )
        return 1
    redis = LocalRedis(root, daemon=True).start()
    for section in missing:
        for name, value in redis.env(section.url_env, section.password_env or PASSWORD_ENV).items():
            print(f"{name}={value}")
    print(
        f"stored responses: in a Redis of this machine's, 127.0.0.1:{redis.port} (stopped with the app)",
        file=sys.stderr,
    )
    return 0


def stop_at(root: Path) -> None:
    """Stop the daemon ``start`` left under ``root``, if it runs."""
    pid_file = root / "redis.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
        pid_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Redis of this machine's for `make serve`'s stored responses.")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start")
    start.add_argument("config", type=Path)
    start.add_argument("root", type=Path)
    commands.add_parser("stop").add_argument("root", type=Path)
    args = parser.parse_args(argv)
    if args.command == "start":
        return start_for(args.config, args.root)
    stop_at(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
