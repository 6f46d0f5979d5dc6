"""CORS on the ingress: off unless configured; when on, preflights need no API key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.config import CORSConfig, IngressConfig
from serve_app.front_door.admission.auth import APIKeys
from serve_app.protocol import WholeAnswer
from tests.unit.front_door.fakes import CHAT, client_for

ORIGIN = "https://chat.example.com"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_off_by_default_no_cors_headers_and_no_preflight():
    assert IngressConfig().cors is None
    client, _ = client_for([WholeAnswer(200, b"{}")])
    response = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
    assert response.status_code == 200
    assert not any(h.lower().startswith("access-control-") for h in response.headers)
    preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_configured_origin_gets_a_preflight_without_an_api_key(monkeypatch):
    monkeypatch.setenv("TEST_API_KEYS", "sk-cors-0123456789abcdef")
    cors = CORSConfig(allow_origins=[ORIGIN])
    client, handle = client_for([WholeAnswer(200, b"{}")], cors=cors, api_keys=APIKeys.from_env("TEST_API_KEYS"))
    preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert preflight.headers["access-control-max-age"] == "600"
    response = client.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Origin": ORIGIN, "Authorization": "Bearer sk-cors-0123456789abcdef"},
    )
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
    refused = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
    assert refused.status_code == 401  # the key is still required; only the preflight is exempt
    assert len(handle.payloads) == 1


def test_other_origins_get_no_cors_headers():
    client, _ = client_for([WholeAnswer(200, b"{}")], cors=CORSConfig(allow_origins=[ORIGIN]))
    preflight = client.options("/v1/chat/completions", headers=PREFLIGHT | {"Origin": "https://evil.example"})
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    response = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


def test_cors_needs_at_least_one_origin():
    with pytest.raises(ValidationError):
        IngressConfig(cors={"allow_origins": []})
