"""Large bodies are checked, and grammars built first, in a separate process: same answers as in line,
bounded in number and (grammars) in time, and the front door survives the process's death."""

from __future__ import annotations

import asyncio
import json
import multiprocessing.context
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from serve_app.config import IngressConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.large_bodies import (
    CHECKER_PRELOAD,
    LARGE_BODY_BYTES,
    MAX_WAITING,
    MAX_WAITING_GRAMMARS,
    BodyChecker,
    CheckedBody,
    check_body,
)
from tests.hostile_requests import BILLION, chat, schema_format, tool
from tests.waiting import wait_until, wait_until_blocking


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


def build_waiting_for_file(request: bytes) -> None:
    """A build that takes until the test says (the file ``request`` names exists), in the checker process."""
    wait_until_blocking(lambda: os.path.exists(request.decode()), 60, "the test releasing the build", every_s=0.01)


async def test_grammars_wait_their_turn_up_to_their_own_bound_then_429(tmp_path: Path):
    """Grammars have a bound of their own, above the large bodies': a structured-output request is
    common, and all wait while the process first starts."""
    checker = BodyChecker(warm=None, build=build_waiting_for_file)
    release = str(tmp_path / "release").encode()
    try:
        waiting = [asyncio.create_task(checker.build_grammar(release, 60, "x")) for _ in range(MAX_WAITING_GRAMMARS)]
        await asyncio.sleep(0)  # one turn of the loop: each task counts itself as waiting, then awaits
        with pytest.raises(APIError) as refused:
            await checker.build_grammar(release, 60, "x")
        assert refused.value.status == 429 and refused.value.code == "overloaded"
        assert MAX_WAITING_GRAMMARS > MAX_WAITING
        (tmp_path / "release").touch()
        assert await asyncio.gather(*waiting) == [None] * MAX_WAITING_GRAMMARS
    finally:
        checker.close()


async def test_one_key_holds_at_most_half_of_the_grammars_waiting_and_others_keep_theirs(tmp_path: Path):
    """A key flooding the checker with specs is refused past half of its places, and another key still
    gets one (in what order turns come: test_checker_turns.py)."""
    checker = BodyChecker(warm=None, build=build_waiting_for_file)
    release = tmp_path / "release"
    share = MAX_WAITING_GRAMMARS // 2
    try:
        flood = [
            asyncio.create_task(checker.build_grammar(str(release).encode(), 60, "x", key="flood"))
            for _ in range(share)
        ]
        await asyncio.sleep(0)  # one turn of the loop: each task counts itself as waiting, then awaits
        with pytest.raises(APIError) as refused:
            await checker.build_grammar(str(release).encode(), 60, "x", key="flood")
        assert (refused.value.status, refused.value.code) == (429, "overloaded")
        assert "API key" in refused.value.message
        other = asyncio.create_task(checker.build_grammar(str(release).encode(), 60, "x", key="other"))
        release.touch()
        assert await asyncio.gather(*flood, other) == [None] * (share + 1)
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


LIMIT_S = IngressConfig().max_grammar_build_s  # the serve configs'


def pickled_chat(**fields) -> bytes:
    return pickle.dumps(chat_request_model().model_validate(chat(**fields)))


async def test_a_grammar_that_takes_minutes_to_build_is_refused_at_the_limit():
    """llguidance builds a billion array items one by one (minutes, and memory that grows with them);
    the build is stopped at the limit with a 400, and the next grammar is built by a new process."""
    costly = {
        "response_format": {"response_format": schema_format({"type": "array", "maxItems": BILLION})},
        "tools": {"tools": [tool({"type": "array", "minItems": BILLION})], "tool_choice": "required"},
    }
    checker = BodyChecker()
    small = pickled_chat(response_format=schema_format({"type": "array", "maxItems": 100}))
    try:
        await checker.build_grammar(small, LIMIT_S, "response_format")
        for param, fields in costly.items():
            with pytest.raises(APIError) as refused:
                await checker.build_grammar(pickled_chat(**fields), LIMIT_S, param)
            assert (refused.value.status, refused.value.code, refused.value.param) == (400, "grammar_too_costly", param)
            await checker.build_grammar(small, LIMIT_S, "response_format")
    finally:
        checker.close()


async def test_a_grammar_its_engine_could_not_build_is_refused_naming_llguidances_error():
    """70,000 optional array items pass vLLM's validation, but llguidance's matcher, which the
    engine builds, fails an assertion; the engine would then let the answer only end (an empty
    200). Given the time (a second here), the checker builds the matcher too and answers 400."""
    checker = BodyChecker()
    try:
        with pytest.raises(APIError) as refused:
            await checker.build_grammar(
                pickled_chat(response_format=schema_format({"type": "array", "maxItems": 70_000})),
                60,
                "response_format",
            )
        assert (refused.value.status, refused.value.code, refused.value.param) == (
            400,
            "invalid_grammar",
            "response_format",
        )
        assert "assertion failed" in refused.value.message and "<backtrace>" not in refused.value.message
    finally:
        checker.close()


def answer_with_pid(request_model: type, raw: bytes, to_json: object = None) -> APIError:
    return APIError(400, str(os.getpid()))


def build_until_killed(request: bytes) -> None:
    """A build that spends CPU until it is killed if asked to (``forever``, or ``forever:<path>``: the
    path made once it runs), or waits without CPU (``wait <seconds>``, ``wait forever``)."""
    if request.startswith(b"forever:"):
        Path(request.removeprefix(b"forever:").decode()).touch()
    while request.startswith(b"forever"):
        pass  # as a costly grammar's build: CPU, all of it
    if request.startswith(b"wait "):
        time.sleep(float(request.removeprefix(b"wait ").replace(b"forever", b"3600")))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed process not yet reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


async def checker_pid(checker: BodyChecker) -> int:
    with pytest.raises(APIError) as answered:
        await checker.check(BaseModel, b"")
    return int(answered.value.message)


async def test_a_build_past_its_limit_kills_the_process_and_another_takes_its_place():
    checker = BodyChecker(answer_with_pid, warm=None, build=build_until_killed)
    try:
        first = await checker_pid(checker)
        with pytest.raises(APIError) as refused:
            await checker.build_grammar(b"forever", 0.2, "structured_outputs")
        assert (refused.value.status, refused.value.code) == (400, "grammar_too_costly")
        await wait_until(lambda: not alive(first), 30, "the checker process killed")
        second = await checker_pid(checker)
        assert second != first and alive(second)
        await checker.build_grammar(b"quick", 0.2, "structured_outputs")
    finally:
        checker.close()


def answer_with_parent_and_imports(request_model: type, raw: bytes, to_json: object = None) -> APIError:
    """The checker's parent process and which of CHECKER_PRELOAD it holds (it ran no warm-up)."""
    held = [name for name in CHECKER_PRELOAD if name in sys.modules]
    return APIError(400, json.dumps({"parent": os.getppid(), "preloaded": held}))


async def test_a_killed_checker_is_replaced_by_a_fork_that_has_vllm_imported_already():
    """Both checkers are forked by one forkserver (not this process) holding vLLM's request models and
    grammar backend: the replacement imports nothing before its first job (a fresh process spends
    seconds of CPU on vLLM's imports)."""
    checker = BodyChecker(answer_with_parent_and_imports, warm=None, build=build_until_killed)
    try:
        seen = []
        for _ in range(2):
            with pytest.raises(APIError) as answered:
                await checker.check(BaseModel, b"")
            seen.append(json.loads(answered.value.message))
            with pytest.raises(APIError):
                await checker.build_grammar(b"forever", 0.2, "structured_outputs")
        first, second = seen
        assert first["parent"] == second["parent"] != os.getpid()
        assert first["preloaded"] == second["preloaded"] == list(CHECKER_PRELOAD)
    finally:
        checker.close()


def import_this_module() -> None:
    """A new checker process's warm-up in these tests: naming it imports this module there, as the
    app's warm-up imports what its jobs need."""


def warm_slowly() -> None:
    time.sleep(2)  # a start slower than the limit, as importing vLLM is


async def test_no_checker_process_is_started_on_the_event_loops_thread(monkeypatch):
    """A process starts through the forkserver, which answers only once it has imported what it
    preloads (seconds, a replica's first time): on the event loop, every stream would stall meanwhile."""
    started_in: list[threading.Thread] = []
    start = multiprocessing.context.ForkServerProcess.start

    def recorded_start(process: Any) -> None:
        started_in.append(threading.current_thread())
        start(process)

    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", recorded_start)
    checker = BodyChecker(answer_with_pid, warm=None, build=build_until_killed)
    try:
        with pytest.raises(APIError):
            await checker.check(BaseModel, b"")
        with pytest.raises(APIError):  # killed past its limit: another process is started
            await checker.build_grammar(b"forever", 0.2, "structured_outputs")
        with pytest.raises(APIError):
            await checker.check(BaseModel, b"")
    finally:
        checker.close()
    assert len(started_in) == 2
    assert threading.main_thread() not in started_in  # (this test's loop runs on the main thread)


async def test_the_time_limit_does_not_count_the_process_start():
    checker = BodyChecker(answer_with_pid, warm=warm_slowly, build=build_until_killed)
    try:
        await checker.build_grammar(b"quick", 0.5, "structured_outputs")
    finally:
        checker.close()


async def test_a_build_whose_client_left_is_still_stopped_at_its_limit_not_counted_in_the_next(tmp_path: Path):
    """The client of an endless build leaves; the build goes on to its own limit and is killed
    there, and the next request's build, waiting its turn meanwhile, gets a whole limit of its own."""
    checker = BodyChecker(answer_with_pid, warm=import_this_module, build=build_until_killed)
    running = tmp_path / "running"
    try:
        first = await checker_pid(checker)
        left = asyncio.create_task(checker.build_grammar(f"forever:{running}".encode(), 1.0, "response_format"))
        await wait_until(running.exists, 30, "the endless build running")
        left.cancel()
        await checker.build_grammar(b"quick", 0.5, "response_format")  # waits for the kill, then a new process
        assert not alive(first)
    finally:
        checker.close()


async def test_the_limit_counts_the_builds_cpu_time_not_its_wait():
    """A build that waits 1 s without CPU (as one on a loaded machine waits for a core) is within a
    limit of 0.5 s; one that never gets CPU is stopped at ten times the limit (the wall-clock backstop)."""
    checker = BodyChecker(answer_with_pid, warm=import_this_module, build=build_until_killed)
    try:
        await checker.build_grammar(b"wait 1", 0.5, "response_format")
        with pytest.raises(APIError) as refused:
            await checker.build_grammar(b"wait forever", 0.2, "response_format")
        assert (refused.value.status, refused.value.code) == (400, "grammar_too_costly")
    finally:
        checker.close()
