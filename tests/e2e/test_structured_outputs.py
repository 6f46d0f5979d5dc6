"""Structured outputs on the real CPU engine: every answer that ends is valid JSON that satisfies its schema.

The tiny model's weights are random, so under a grammar it writes whatever the grammar
allows (control characters, any script, long strings): the hardest client there is. For
each schema of ``tests/json_schemas.py`` and 8 seeds, through ``response_format``
(``json_schema``, ``strict``) and through forced tool calls (a named function and
``"required"``): an answer ends either with ``stop`` (or ``tool_calls``) and parses and
validates, or with ``length`` (cut by ``max_tokens``, the only incomplete JSON).
Keywords the grammar cannot enforce are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.e2e.harness.sse import post_stream
from tests.json_schemas import SCHEMAS, UNENFORCEABLE, parse_and_check

SEEDS = range(30)  # the report's
# Per schema and way to ask: 208 answers in all, each decoded from a random model under its
# grammar (8, from 20: the same property on each answer, at 40% of the engine's time).
PROPERTY_SEEDS = range(8)
ASK = [{"role": "user", "content": "Fill in the form."}]
# A tool's schema is part of the prompt, and the tiny model's tokenizer spends about a token a
# byte on it: these leave room for the answer in its 1024-token context ("order" and "pet"
# take more than all of it). The grammar compiled for a tool's schema is the one above.
TOOL_SCHEMAS = ("profile", "event", "lengths", "pattern_and_length", "enum_const", "numbers", "any_of", "array_counts")
PATHS = ("response_format", "named tool", "required tool")


def _without_annotations(schema: Any) -> Any:
    """The schema without titles and descriptions (only the prompt sees them)."""
    if isinstance(schema, dict):
        return {k: _without_annotations(v) for k, v in schema.items() if k not in ("title", "description")}
    if isinstance(schema, list):
        return [_without_annotations(v) for v in schema]
    return schema


def body(path: str, schema: dict[str, Any], model: str, seed: int | None = None) -> dict[str, Any]:
    """A chat request decoded under ``schema`` by ``path``; no max_tokens: what the context leaves."""
    request: dict[str, Any] = {"model": model, "messages": ASK, "seed": seed}
    if path == "response_format":
        json_schema = {"name": "form", "schema": copy.deepcopy(schema), "strict": True}
        return request | {"response_format": {"type": "json_schema", "json_schema": json_schema}}
    function = {"name": "fill", "parameters": _without_annotations(schema), "strict": True}
    choice = {"type": "function", "function": {"name": "fill"}} if path == "named tool" else "required"
    return request | {
        "tools": [{"type": "function", "function": function}],
        "tool_choice": choice,
        "parallel_tool_calls": False,
    }


def answer_json(path: str, choice: dict[str, Any]) -> str | None:
    """The JSON text the schema constrained: the content, or the one call's arguments."""
    message = choice["message"]
    if path == "response_format":
        return message["content"]
    calls = message.get("tool_calls") or []
    assert len(calls) <= 1, message
    return calls[0]["function"]["arguments"] if calls else None


@pytest.fixture
async def http(app):
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=app.url, timeout=300, limits=limits) as client:
        yield client


async def test_every_answer_that_ends_parses_and_satisfies_its_schema(app, http):
    cases = [(path, name, seed) for path in PATHS for name in SCHEMAS for seed in PROPERTY_SEEDS]
    cases = [(path, name, seed) for path, name, seed in cases if path == "response_format" or name in TOOL_SCHEMAS]

    async def one(path: str, name: str, seed: int) -> tuple[str, str, str]:
        response = await http.post("/v1/chat/completions", json=body(path, SCHEMAS[name], app.model, seed))
        assert response.status_code == 200, (path, name, seed, response.text)
        [choice] = response.json()["choices"]
        finish, text = choice["finish_reason"], answer_json(path, choice)
        if finish == "length":
            return path, name, finish
        assert finish == {"response_format": "stop", "named tool": "stop", "required tool": "tool_calls"}[path]
        assert text is not None, (path, name, seed, choice)
        try:
            parse_and_check(text, SCHEMAS[name])
        except ValueError as error:  # json's and jsonschema's errors both are
            pytest.fail(f"{path}, {name}, seed {seed}: {text!r} is not a valid answer: {error}")
        return path, name, finish

    finishes = Counter(await asyncio.gather(*(one(*case) for case in cases)))
    print(dict(finishes))
    for path in PATHS:
        for name in SCHEMAS if path == "response_format" else TOOL_SCHEMAS:
            ended = sum(n for (p, s, finish), n in finishes.items() if (p, s) == (path, name) and finish != "length")
            assert ended, f"no answer under {name} by {path} ended within the context: nothing was checked"


async def test_the_issues_profile_parses_in_30_of_30_answers(app, http):
    """The report: a pydantic model with one ``max_length`` field, ``strict``, seeds 0-29: 23 of 30 did not parse."""
    answers = await asyncio.gather(
        *(
            http.post("/v1/chat/completions", json=body("response_format", SCHEMAS["profile"], app.model, s))
            for s in SEEDS
        )
    )
    choices = [a.json()["choices"][0] for a in answers]
    assert [c["finish_reason"] for c in choices] == ["stop"] * len(SEEDS)
    for choice in choices:
        profile = parse_and_check(choice["message"]["content"], SCHEMAS["profile"])
        assert len(profile["name"]) <= 12


async def test_streamed_answers_join_into_valid_json(app, http):
    """The deltas of a streamed answer, joined as a client library joins them, parse and validate."""
    schema = SCHEMAS["order"]
    requests = [body("response_format", schema, app.model, seed) | {"stream": True} for seed in SEEDS[:10]]
    streams = await asyncio.gather(*(post_stream(http, "/v1/chat/completions", r) for r in requests))
    finishes = []
    for stream in streams:
        assert stream.done, stream.events[-1:]
        choices = [choice for chunk in stream.chunks for choice in chunk["choices"]]
        finishes.append(next(c["finish_reason"] for c in reversed(choices) if c["finish_reason"]))
        if finishes[-1] == "stop":
            parse_and_check("".join(c["delta"].get("content") or "" for c in choices), schema)
    assert "stop" in finishes and set(finishes) <= {"stop", "length"}, finishes


async def test_an_answer_cut_by_max_tokens_is_the_only_incomplete_json(app, http):
    request = body("response_format", SCHEMAS["profile"], app.model, 0) | {"max_tokens": 6}
    [choice] = (await http.post("/v1/chat/completions", json=request)).json()["choices"]
    assert choice["finish_reason"] == "length"
    with pytest.raises(ValueError):
        parse_and_check(choice["message"]["content"], SCHEMAS["profile"])


async def test_json_object_answers_are_json_objects(app, http):
    requests = [
        {"model": app.model, "messages": ASK, "seed": seed, "response_format": {"type": "json_object"}}
        for seed in SEEDS
    ]
    answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=r) for r in requests))
    choices = [a.json()["choices"][0] for a in answers]
    ended = [c for c in choices if c["finish_reason"] == "stop"]
    assert ended and all(c["finish_reason"] in ("stop", "length") for c in choices)
    for choice in ended:
        parse_and_check(choice["message"]["content"], {"type": "object"})


@pytest.mark.parametrize("path", PATHS)
async def test_a_schema_that_spells_control_tokens_gets_them_as_text(app, http, path):
    """GLM-4's control-token texts in a schema are written as text (a 500 without the app's vLLM plugin)."""
    properties = {"turn": {"const": "<|user|>"}, "note": {"enum": ["<|observation|> ok", "[gMASK]"]}}
    schema = {"type": "object", "properties": properties, "required": ["turn", "note"], "additionalProperties": False}
    response = await http.post("/v1/chat/completions", json=body(path, schema, app.model, 0))
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] in ("stop", "tool_calls")
    answer = parse_and_check(answer_json(path, choice) or "", schema)
    assert answer["turn"] == "<|user|>"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("keyword", UNENFORCEABLE)
async def test_a_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(app, http, keyword, path):
    response = await http.post("/v1/chat/completions", json=body(path, UNENFORCEABLE[keyword], app.model))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert ("color" if keyword == "format" else keyword) in error["message"]
