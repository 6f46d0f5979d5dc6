"""Malformed and hostile requests against the real app: each gets its OpenAI-shaped 4xx,
fuzzed bodies never get a 5xx or hang, and the server stays healthy throughout."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.hostile_requests import CHAT_PATH, HOSTILE, Hostile, chat, padded
from tests.openai_errors import assert_openai_error
from tests.request_strategies import request_bodies

FUZZ_MAX_TOKENS = 8  # answers the server accepts stay short: the fuzzing is about input


@pytest.fixture(scope="module")
def client(app):
    # A generous timeout: "never hangs" means every request is answered well inside it.
    with httpx.Client(base_url=app.url, timeout=60) as client:
        yield client


def assert_healthy(client: httpx.Client, model: str) -> None:
    assert client.get("/health").status_code == 200
    answer = client.post(CHAT_PATH, json=chat(model=model, max_tokens=4, min_tokens=4))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.id)
def test_hostile_request_gets_its_4xx_naming_the_parameter(client, case: Hostile):
    response = client.request(case.method, case.path, content=case.body, headers=case.headers)
    assert_openai_error(response, case.status, case.param)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_large_valid_body_is_answered(client, app, stream: bool):
    """Checked in the front door's checker process, handed on pickled, unpickled and answered by a model replica."""
    body = padded(chat(model=app.model, max_tokens=4, min_tokens=4, stream=stream))
    response = client.post(CHAT_PATH, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]") and response.text.count('"content"') >= 1
    else:
        assert response.json()["usage"]["completion_tokens"] == 4


def test_server_is_healthy_after_the_hostile_table(client, app):
    assert len(HOSTILE) >= 30
    assert_healthy(client, app.model)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=request_bodies(max_output=FUZZ_MAX_TOKENS))
def test_fuzzed_bodies_never_get_a_5xx(client, request: tuple[str, bytes]):
    path, body = request
    response = client.post(path, content=body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code, None)


def test_server_is_healthy_after_fuzzing(client, app):
    assert_healthy(client, app.model)
