"""`make serve`'s Redis for a config that keeps stored responses in Redis (tools/local_redis.py), on
Debian's redis-server, as `make serve` runs it: a daemon under a path relative to the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.waiting import wait_until_blocking
from tools.local_redis import main, stop_at

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_a_config_naming_redis_gets_a_daemon_with_a_password_stopped_by_its_pid_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RESPONSES_STORE_URL", raising=False)
    assert main(["start", str(DEPLOY / "config.sim.yaml"), ".venv/responses-redis"]) == 0
    env = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert env.keys() == {"RESPONSES_STORE_URL", "RESPONSES_STORE_PASSWORD"}
    client = redis.Redis.from_url(env["RESPONSES_STORE_URL"], password=env["RESPONSES_STORE_PASSWORD"])
    try:
        assert client.ping()
        with redis.Redis.from_url(env["RESPONSES_STORE_URL"]) as anyone, pytest.raises(redis.AuthenticationError):
            anyone.ping()
    finally:
        stop_at(Path(".venv/responses-redis"))

    def stopped() -> bool:
        try:
            client.ping()
        except redis.ConnectionError:
            return True
        return False

    wait_until_blocking(stopped, 30, "the daemon stopped")


def test_a_config_keeping_responses_in_memory_starts_nothing(tmp_path, capsys):
    assert main(["start", str(DEPLOY / "config.cpu.yaml"), str(tmp_path / "redis")]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "in the model replica's memory" in out.err
