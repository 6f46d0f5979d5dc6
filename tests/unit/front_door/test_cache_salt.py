"""Each API key's prompts cached apart: every request of a key carries its key's ``cache_salt``."""

from __future__ import annotations

import pytest
from vllm.entrypoints.generate.base.protocol import validate_cache_salt

from serve_app.config import IngressConfig
from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.cache_salt import key_cache_salt
from serve_app.protocol import WholeAnswer
from tests.unit.front_door.fakes import CHAT, client_for

FIRST, SECOND = "sk-first-0123456789abc", "sk-second-abcdef012345"


@pytest.fixture
def keys(monkeypatch) -> APIKeys:
    monkeypatch.setenv("TEST_API_KEYS", f"{FIRST}\n{SECOND}\n")
    return APIKeys.from_env("TEST_API_KEYS")


def salts_sent(keys: APIKeys, isolate: bool, requests: list[tuple[str, dict]]) -> list[str | None]:
    """The ``cache_salt`` of each request as it reached the engine, sent with each key and body."""
    client, handle = client_for([WholeAnswer(200, b"{}")], api_keys=keys, isolate_prefix_cache=isolate)
    for key, body in requests:
        response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
    return [payload.cache_salt for payload in handle.payloads]


def test_each_keys_requests_carry_its_own_salt_with_the_clients_folded_in(keys):
    first, second = keys.identify(FIRST), keys.identify(SECOND)
    assert first is not None and second is not None
    own = CHAT | {"cache_salt": "user-7"}
    sent = salts_sent(keys, True, [(FIRST, CHAT), (FIRST, CHAT), (SECOND, CHAT), (SECOND, own)])
    assert sent == [key_cache_salt(first)] * 2 + [key_cache_salt(second), key_cache_salt(second, "user-7")]
    assert len(set(sent)) == 3
    # No salt a client sends makes its request share another key's cache.
    assert key_cache_salt(first) not in {key_cache_salt(second, salt) for salt in ("", key_cache_salt(first))}


def test_where_the_keys_trust_each_other_a_request_keeps_what_it_sent(keys):
    own = CHAT | {"cache_salt": "user-7"}
    assert salts_sent(keys, False, [(FIRST, CHAT), (SECOND, own)]) == [None, "user-7"]


def test_a_salt_is_one_vllm_accepts():
    salt = key_cache_salt("0123456789abcdef", "x" * 128)
    validate_cache_salt(salt)
    assert len(salt) == 43


def test_each_keys_cache_is_apart_by_default_wherever_there_are_keys():
    keyed = {"api_keys": {"env": "KEYS"}}
    assert IngressConfig.model_validate(keyed).isolates_prefix_cache
    assert not IngressConfig.model_validate(keyed | {"prefix_cache_per_key": False}).isolates_prefix_cache
    assert not IngressConfig().isolates_prefix_cache  # no keys: one tenant
