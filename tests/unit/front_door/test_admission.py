"""What the admission of a request leaves in its record about its grammar's build (counted by the metrics)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serve_app.errors import APIError
from serve_app.front_door.admission.pipeline import build_grammar_first
from serve_app.front_door.telemetry.record import GRAMMAR_BUILT, RequestRecord


class Checker:
    """Stands in for the replica's checker process: builds, or refuses with ``error``."""

    def __init__(self, error: APIError | None = None) -> None:
        self.error = error
        self.builds = 0

    async def build_grammar(self, request: bytes, time_limit_s: float, param: str, key: str | None = None) -> None:
        if self.error is not None:
            raise self.error
        self.builds += 1


def settings(checker: Checker) -> SimpleNamespace:
    """The rules' parts a grammar's build reads (a BodyRules)."""
    return SimpleNamespace(
        settings=SimpleNamespace(costs=SimpleNamespace(max_grammar_build_s=10.0)), body_checker=checker
    )


WITH_GRAMMAR = SimpleNamespace(grammar_chars=30, grammar_param="response_format")


async def test_a_built_grammar_is_recorded_as_built():
    record, checker = RequestRecord("chat"), Checker()
    await build_grammar_first(settings(checker), {"p": 1}, WITH_GRAMMAR, record)
    assert record.grammar_build == GRAMMAR_BUILT and checker.builds == 1


@pytest.mark.parametrize("code", ["grammar_too_costly", "invalid_grammar"])
async def test_a_refused_build_is_recorded_by_its_code(code):
    record = RequestRecord("chat")
    with pytest.raises(APIError):
        await build_grammar_first(settings(Checker(APIError(400, "no", code=code))), {}, WITH_GRAMMAR, record)
    assert record.grammar_build == code


async def test_no_build_is_recorded_when_the_checker_had_no_place_or_there_was_no_grammar():
    record = RequestRecord("chat")
    with pytest.raises(APIError):
        busy = Checker(APIError(429, "busy", code="overloaded"))
        await build_grammar_first(settings(busy), {}, WITH_GRAMMAR, record)
    assert record.grammar_build is None
    plain = RequestRecord("chat")
    await build_grammar_first(settings(Checker()), {}, SimpleNamespace(grammar_chars=0, grammar_param=None), plain)
    assert plain.grammar_build is None
