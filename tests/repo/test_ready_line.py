"""The ready line reads where the app answers and what it serves from the serve config itself."""

from __future__ import annotations

from pathlib import Path

import yaml

from tools.ready_line import LocalApp, local_apps, wait_until_ready

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_cpu_config_answers_on_loopback_with_its_model() -> None:
    [app] = local_apps(yaml.safe_load((DEPLOY / "config.cpu.yaml").read_text()))
    assert app == LocalApp("http://127.0.0.1:8000", ("glm-4-9b-chat",))
    assert app.line() == (
        "ready: http://127.0.0.1:8000/v1 serves glm-4-9b-chat; stored responses live in the model replica's memory "
        "(Ctrl-C stops it)"
    )


def test_the_simulated_config_says_its_stored_responses_live_in_redis() -> None:
    [app] = local_apps(yaml.safe_load((DEPLOY / "config.sim.yaml").read_text()))
    assert app.responses_in_redis and "stored responses live in Redis" in app.line()


def test_a_wildcard_host_and_a_route_prefix_for_each_application() -> None:
    config = {
        "http_options": {"host": "0.0.0.0", "port": 9001},
        "applications": [
            {"route_prefix": "/glm/", "args": {"models": [{"name": "a"}, {"name": "b"}]}},
            {"route_prefix": "/", "args": {"models": [{"name": "c"}]}},
        ],
    }
    assert local_apps(config) == [
        LocalApp("http://127.0.0.1:9001/glm", ("a", "b")),
        LocalApp("http://127.0.0.1:9001", ("c",)),
    ]


def test_nothing_listening_is_not_ready() -> None:
    assert not wait_until_ready(LocalApp("http://127.0.0.1:9", ("m",)), timeout_s=0.5)
