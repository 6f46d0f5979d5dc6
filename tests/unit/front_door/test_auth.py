"""API keys on the front door's HTTP app: who gets through, what the others get, rotation."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.config import APIKeysConfig, IngressConfig
from serve_app.front_door.admission.auth import (
    APIKeys,
    APIKeysUnavailable,
    load_api_keys,
    parse_keys,
)
from serve_app.front_door.admission.route_path import route_path
from serve_app.protocol import WholeAnswer
from tests.openai_errors import assert_openai_error
from tests.unit.front_door.fakes import CHAT, client_for

FIRST, SECOND, THIRD = "sk-first-0123456789abc", "sk-second-abcdef012345", "sk-third-9876543210zyx"
KEYS = f"# rotated 2026-11\n{FIRST}\n\n  {SECOND}  \n{THIRD}\n"


@pytest.fixture
def env_keys(monkeypatch) -> APIKeys:
    monkeypatch.setenv("TEST_API_KEYS", KEYS)
    return APIKeys.from_env("TEST_API_KEYS")


def chat_with(client, authorization: str | None):
    headers = {"Authorization": authorization} if authorization is not None else {}
    return client.post("/v1/chat/completions", json=CHAT, headers=headers)


@pytest.mark.parametrize("key", [FIRST, SECOND, THIRD])
def test_each_configured_key_is_accepted(env_keys, key):
    client, handle = client_for([WholeAnswer(200, b"{}")], api_keys=env_keys)
    assert chat_with(client, f"Bearer {key}").status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
    assert len(handle.payloads) == 1


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        THIRD,
        "Basic c2stdGhpcmQ=",
        f"Bearer {THIRD[:-1]}",
        f"Bearer {THIRD}2",
        f"Bearer {THIRD.upper()}",
        f"Bearer {FIRST},{THIRD}",
        "Bearer #",
        "Bearer rotated",
        "Bearer 2026-11",
    ],
)
def test_missing_or_wrong_keys_get_401_and_reach_no_replica(env_keys, authorization):
    client, handle = client_for([WholeAnswer(200, b"{}")], api_keys=env_keys)
    for response in (
        chat_with(client, authorization),
        client.get("/v1/models", headers=({"Authorization": authorization} if authorization is not None else {})),
    ):
        error = assert_openai_error(response, 401)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert "sk-" not in response.text  # neither the presented nor a configured key is echoed
    assert handle.payloads == []


def test_unknown_v1_paths_are_401_before_404_so_they_reveal_nothing(env_keys):
    client, _ = client_for([], api_keys=env_keys)
    assert_openai_error(client.get("/v1/secrets"), 401)
    assert_openai_error(client.get("/v1/secrets", headers={"Authorization": f"Bearer {THIRD}"}), 404)


def test_paths_are_matched_below_the_route_prefix():
    assert route_path({"path": "/glm/v1/models", "root_path": "/glm"}) == "/v1/models"
    assert route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
    assert route_path({"path": "/v1/models"}) == "/v1/models"


def test_health_stays_open(env_keys):
    client, _ = client_for([], api_keys=env_keys)
    assert client.get("/health").status_code == 200


def test_without_keys_configured_no_header_is_needed():
    client, _ = client_for([WholeAnswer(200, b"{}")])
    assert chat_with(client, None).status_code == 200


def test_configured_but_empty_source_refuses_to_start(monkeypatch, tmp_path):
    monkeypatch.setenv("TEST_API_KEYS", " \n# only a comment\n")
    with pytest.raises(APIKeysUnavailable, match="environment variable TEST_API_KEYS"):
        APIKeys.from_env("TEST_API_KEYS")
    monkeypatch.delenv("TEST_API_KEYS")
    with pytest.raises(APIKeysUnavailable):
        load_api_keys(APIKeysConfig(env="TEST_API_KEYS"))
    with pytest.raises(APIKeysUnavailable, match="missing"):
        APIKeys.from_file(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f"alice {FIRST}\n", "line 1 holds whitespace inside a key"),
        (f"{FIRST}, {SECOND}\n", "line 1 holds whitespace inside a key"),
        (f"{FIRST}\nsk-short\n", "line 2 holds a key shorter than 20 characters"),
        (f"{FIRST}\tcomment\n", "line 1 holds whitespace inside a key"),
    ],
)
def test_a_malformed_key_source_refuses_to_start_and_names_the_line_not_the_key(monkeypatch, text, why):
    monkeypatch.setenv("TEST_API_KEYS", text)
    with pytest.raises(APIKeysUnavailable, match=why) as refused:
        APIKeys.from_env("TEST_API_KEYS")
    assert "sk-" not in str(refused.value) and "alice" not in str(refused.value)


def test_comments_and_blank_lines_are_not_keys(env_keys):
    assert len(parse_keys(KEYS)) == 3
    for word in ("#", "rotated", "2026-11", "# rotated 2026-11", ""):
        assert env_keys.identify(word) is None


def write_keys(path: Path, text: str, mtime: float) -> None:
    path.write_text(text)
    os.utime(path, (mtime, mtime))  # a distinct mtime even on coarse-grained filesystems


OLD, NEW = "sk-old-0123456789abcdef", "sk-new-0123456789abcdef"


@pytest.fixture
def key_file(tmp_path) -> tuple[Path, APIKeys]:
    path = tmp_path / "keys"
    write_keys(path, f"{OLD}\n", 1_000)
    keys = load_api_keys(APIKeysConfig(file=str(path)))
    assert keys is not None
    keys.recheck_s = 0.0
    return path, keys


def test_a_rotated_key_file_takes_effect_without_a_restart(key_file):
    path, keys = key_file
    assert keys.identify(OLD) is not None and keys.identify(NEW) is None
    write_keys(path, f"# rotated\n{NEW}\n", 2_000)
    assert keys.identify(NEW) is not None and keys.identify(OLD) is None


@pytest.mark.parametrize("text", [f"{NEW}\nshort-key\n", f"{NEW} {OLD}\n"])
def test_a_malformed_reload_keeps_the_previous_keys_and_logs_an_error(key_file, caplog, text):
    path, keys = key_file
    write_keys(path, text, 2_000)
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        assert keys.identify(OLD) is not None and keys.identify(NEW) is None
    [record] = caplog.records
    assert record.levelno == logging.ERROR and "keeping the previous 1" in record.getMessage()
    assert "sk-" not in record.getMessage()


def test_an_unreadable_file_keeps_the_previous_keys(key_file, caplog):
    path, keys = key_file
    path.unlink()
    os.mkdir(path)  # a new mtime, and read_text fails
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        assert keys.identify(OLD) is not None
    assert "not reloaded" in caplog.text


def test_an_emptied_file_revokes_every_key_and_logs_one_error(key_file, caplog):
    path, keys = key_file
    write_keys(path, "# all keys revoked\n", 2_000)
    client, handle = client_for([WholeAnswer(200, b"{}")], api_keys=keys)
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        for _ in range(3):
            assert_openai_error(chat_with(client, f"Bearer {OLD}"), 401)
    assert handle.payloads == []
    assert len([r for r in caplog.records if "revoked" in r.getMessage()]) == 1
    write_keys(path, f"{NEW}\n", 3_000)  # and a new key brings service back
    assert chat_with(client, f"Bearer {NEW}").status_code == 200


def test_the_file_is_rechecked_at_most_once_per_interval(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, OLD, 1_000)
    keys = APIKeys.from_file(str(path), recheck_s=3600)
    write_keys(path, NEW, 2_000)
    assert keys.identify(OLD) is not None and keys.identify(NEW) is None  # no stat per request


def test_keys_are_kept_only_as_digests(env_keys):
    assert not any(b"sk-" in digest for digest in parse_keys(KEYS))
    assert "sk-" not in repr(env_keys)


@pytest.mark.parametrize(
    "source", [{}, {"env": "A", "file": "/keys"}, {"env": "NOT A NAME"}, {"file": ""}, {"env": "A", "extra": 1}]
)
def test_config_needs_exactly_one_valid_source(source):
    with pytest.raises(ValidationError):
        IngressConfig(api_keys=source)


def test_keys_are_off_unless_configured():
    assert IngressConfig().api_keys is None
    assert load_api_keys(None) is None


def test_check_does_not_stop_at_the_first_matching_key(env_keys, monkeypatch):
    import serve_app.front_door.admission.auth as auth

    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert env_keys.identify(FIRST) is not None
    assert len(compared) == 3, "every key is compared, whichever matches"
