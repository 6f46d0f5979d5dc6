"""The one check that an answer is an OpenAI-shaped error, for unit and end-to-end tests alike."""

from __future__ import annotations

from typing import Any


def assert_openai_error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    """``response`` (httpx's, or Starlette's test client's) is an OpenAI-shaped error with ``status``
    (and ``param``, when given), with no traceback in it; its ``error`` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert param is None or error["param"] == param, error
    assert "Traceback" not in response.text
    return error
