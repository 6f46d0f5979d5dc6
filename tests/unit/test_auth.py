"""API keys on the ingress's HTTP app: who gets through, what the others get, rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.auth import APIKeys, APIKeysUnavailable, load_api_keys, parse_keys, route_path
from serve_app.config import APIKeysConfig, IngressConfig
from serve_app.streaming import Reply
from tests.unit.test_http import CHAT, assert_openai_error, client_for

KEYS = "sk-first-0123456789, sk-second-abcdef\nsk-third"


@pytest.fixture
def env_keys(monkeypatch) -> APIKeys:
    monkeypatch.setenv("TEST_API_KEYS", KEYS)
    return APIKeys.from_env("TEST_API_KEYS")


def chat_with(client, authorization: str | None):
    headers = {"Authorization": authorization} if authorization is not None else {}
    return client.post("/v1/chat/completions", json=CHAT, headers=headers)


@pytest.mark.parametrize("key", ["sk-first-0123456789", "sk-second-abcdef", "sk-third"])
def test_each_configured_key_is_accepted(env_keys, key):
    client, handle = client_for([Reply(200, b"{}")], api_keys=env_keys)
    assert chat_with(client, f"Bearer {key}").status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
    assert len(handle.payloads) == 1


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "sk-third", "Basic c2stdGhpcmQ=", "Bearer sk-thir", "Bearer sk-third2",
     "Bearer SK-THIRD", "Bearer sk-first-0123456789,sk-third"],
)
def test_missing_or_wrong_keys_get_401_and_reach_no_replica(env_keys, authorization):
    client, handle = client_for([Reply(200, b"{}")], api_keys=env_keys)
    for response in (chat_with(client, authorization), client.get("/v1/models", headers=(
        {"Authorization": authorization} if authorization is not None else {}
    ))):
        error = assert_openai_error(response, 401)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert "sk-" not in response.text  # neither the presented nor a configured key is echoed
    assert handle.payloads == []


def test_unknown_v1_paths_are_401_before_404_so_they_reveal_nothing(env_keys):
    client, _ = client_for([], api_keys=env_keys)
    assert_openai_error(client.get("/v1/secrets"), 401)
    assert_openai_error(client.get("/v1/secrets", headers={"Authorization": "Bearer sk-third"}), 404)


def test_paths_are_matched_below_the_route_prefix():
    assert route_path({"path": "/glm/v1/models", "root_path": "/glm"}) == "/v1/models"
    assert route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
    assert route_path({"path": "/v1/models"}) == "/v1/models"


def test_health_stays_open(env_keys):
    client, _ = client_for([], api_keys=env_keys)
    assert client.get("/health").status_code == 200


def test_without_keys_configured_no_header_is_needed():
    client, _ = client_for([Reply(200, b"{}")])
    assert chat_with(client, None).status_code == 200


def test_configured_but_empty_source_refuses_to_start(monkeypatch, tmp_path):
    monkeypatch.setenv("TEST_API_KEYS", " ,\n")
    with pytest.raises(APIKeysUnavailable, match="environment variable TEST_API_KEYS"):
        APIKeys.from_env("TEST_API_KEYS")
    monkeypatch.delenv("TEST_API_KEYS")
    with pytest.raises(APIKeysUnavailable):
        load_api_keys(APIKeysConfig(env="TEST_API_KEYS"))
    with pytest.raises(APIKeysUnavailable, match="missing"):
        APIKeys.from_file(str(tmp_path / "missing"))


def write_keys(path: Path, text: str, mtime: float) -> None:
    path.write_text(text)
    os.utime(path, (mtime, mtime))  # a distinct mtime even on coarse-grained filesystems


def test_a_rotated_key_file_takes_effect_without_a_restart(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, "sk-old\n", 1_000)
    keys = load_api_keys(APIKeysConfig(file=str(path)))
    keys.recheck_s = 0.0
    assert keys.accepts("sk-old") and not keys.accepts("sk-new")
    write_keys(path, "sk-new\n", 2_000)
    assert keys.accepts("sk-new") and not keys.accepts("sk-old")
    write_keys(path, "", 3_000)  # emptied (or half-written): the previous keys stay
    assert keys.accepts("sk-new")
    path.unlink()
    assert keys.accepts("sk-new")


def test_the_file_is_rechecked_at_most_once_per_interval(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, "sk-old", 1_000)
    keys = APIKeys.from_file(str(path), recheck_s=3600)
    write_keys(path, "sk-new", 2_000)
    assert keys.accepts("sk-old") and not keys.accepts("sk-new")  # no stat per request


def test_keys_are_kept_only_as_digests(env_keys):
    assert not any(b"sk-" in digest for digest in parse_keys(KEYS))
    assert "sk-" not in repr(env_keys)
    assert len(parse_keys(KEYS)) == 3


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
    import serve_app.auth as auth

    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert env_keys.accepts("sk-first-0123456789")
    assert len(compared) == 3, "every key is compared, whichever matches"
