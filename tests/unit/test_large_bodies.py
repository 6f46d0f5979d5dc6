"""Large bodies are checked in a separate process: same answers as in line, bounded, and survive its death."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from serve_app.errors import APIError
from serve_app.ingress.large_bodies import (
    LARGE_BODY_BYTES,
    MAX_WAITING,
    BodyChecker,
    CheckedBody,
    check_body,
)
from tests.hostile_requests import chat
from tests.waiting import wait_until_blocking


def chat_request_model() -> type[BaseModel]:
    """vLLM's model, imported only where used: a checker process importing this module stays light."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


def large(**fields) -> bytes:
    """A valid chat body made large by whitespace: a big body with a small request in it."""
    body = json.dumps(chat(max_completion_tokens=5, **fields)).encode()
    return body[:-1] + b" " * LARGE_BODY_BYTES + b"}"


def test_a_valid_body_comes_back_as_the_fields_the_ingress_checks_and_the_pickled_request():
    ChatCompletionRequest = chat_request_model()
    checked = check_body(ChatCompletionRequest, large(n=2, stream=True, metadata={"a": 1}))
    assert isinstance(checked, CheckedBody)
    assert checked.fields == {"model": chat()["model"], "n": 2, "max_tokens": 4, "max_completion_tokens": 5}
    request = checked.request.load()
    assert isinstance(request, ChatCompletionRequest)
    assert (request.n, request.max_completion_tokens, request.stream) == (2, 5, True)
    assert checked.request.request_id == request.request_id and checked.request.stream


def test_an_invalid_body_comes_back_as_the_error_the_client_gets():
    error = check_body(chat_request_model(), large(temperature="hot"))
    assert isinstance(error, APIError)
    assert (error.status, error.param) == (400, "temperature")


async def test_the_checker_process_answers_as_check_body_does():
    checker = BodyChecker()
    try:
        checked = await checker.check(chat_request_model(), large())
        assert checked.request.load().max_completion_tokens == 5
        with pytest.raises(APIError) as raised:
            await checker.check(chat_request_model(), large(top_p=7))
        assert (raised.value.status, raised.value.param) == (400, "top_p")
    finally:
        checker.close()


def wait_for_file(request_model: type, raw: bytes, to_json: object = None) -> APIError:
    """A check that takes until the test says (the file ``raw`` names exists), in the checker process."""
    try:
        wait_until_blocking(lambda: os.path.exists(raw.decode()), 60, "the test releasing the check", every_s=0.01)
    except AssertionError:
        return APIError(500, "the test never released the check")
    return APIError(400, "checked")


def die(request_model: type, raw: bytes, to_json: object = None) -> APIError:
    if raw == b"die":
        os._exit(1)
    return APIError(400, "checked")


async def test_more_than_max_waiting_large_bodies_are_refused_with_429(tmp_path: Path):
    checker = BodyChecker(wait_for_file, warm=None)
    release = tmp_path / "release"
    try:
        waiting = [asyncio.create_task(checker.check(BaseModel, str(release).encode())) for _ in range(MAX_WAITING)]
        await asyncio.sleep(0)  # one turn of the loop: each task counts itself as waiting, then awaits
        with pytest.raises(APIError) as refused:
            await checker.check(BaseModel, str(release).encode())
        assert refused.value.status == 429 and refused.value.code == "overloaded"
        release.touch()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert [str(r) for r in results] == ["400 Bad Request: checked"] * MAX_WAITING
        with pytest.raises(APIError, match="checked"):  # room again
            await checker.check(BaseModel, str(release).encode())
    finally:
        checker.close()


async def test_a_checker_process_that_dies_costs_its_body_a_500_and_is_replaced():
    checker = BodyChecker(die, warm=None)
    try:
        with pytest.raises(APIError) as failed:
            await checker.check(BaseModel, b"die")
        assert failed.value.status == 500
        with pytest.raises(APIError, match="checked"):
            await checker.check(BaseModel, b"fine")
    finally:
        checker.close()
