"""Structured outputs as LangChain's and instructor's users ask for them, against a running app.

Run by tests/e2e/test_client_libraries.py in the client libraries' own environment
(.venv-clients, pyproject.toml's ``clients`` group: instructor pins an older openai and
jiter than the app's tests use). For each seed, one pydantic model through
``ChatOpenAI(...).with_structured_output(Profile, method="json_schema", strict=True)``
and through ``instructor.from_openai(..., mode=Mode.JSON_SCHEMA)``, exactly as their
documentation shows, every seed's call at once from threads, both libraries together (as a
server's users send them).
Prints one JSON line: per library, how many answers parsed, how
many were cut by the token limit (the libraries raise for those, as they should), and
every other failure with its message.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import instructor
import openai
from instructor.core.exceptions import IncompleteOutputException, InstructorRetryException
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

ASK = "Fill in the profile of a sailor."
CONCURRENT = 16  # calls at once, each library's own client shared by the threads


class Profile(BaseModel):
    """The model of the report: two strings, one with a maximum length."""

    name: str = Field(max_length=12)
    bio: str


def langchain_call(url: str, model: str) -> Callable[[int], Profile]:
    def call(seed: int) -> Profile:
        chat = ChatOpenAI(base_url=url, api_key="unused", model=model, seed=seed, max_retries=0)
        answer = chat.with_structured_output(Profile, method="json_schema", strict=True).invoke(ASK)
        assert isinstance(answer, Profile)
        return answer

    return call


def instructor_call(url: str, model: str) -> Callable[[int], Profile]:
    client = instructor.from_openai(
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0), mode=instructor.Mode.JSON_SCHEMA
    )

    def call(seed: int) -> Profile:
        messages: Any = [{"role": "user", "content": ASK}]
        return client.chat.completions.create(
            model=model, response_model=Profile, messages=messages, seed=seed, max_retries=0
        )

    return call


def cut_by_the_token_limit(error: Exception) -> bool:
    """The library refused an answer because ``finish_reason`` was ``length``."""
    if isinstance(error, InstructorRetryException):
        error = error.__cause__ or error
    return isinstance(error, (openai.LengthFinishReasonError, IncompleteOutputException))


def outcome(call: Callable[[int], Profile], seed: int) -> str:
    """``parsed``, ``cut``, or the failure's message."""
    try:
        call(seed)
        return "parsed"
    except Exception as error:
        if cut_by_the_token_limit(error):
            return "cut"
        return f"seed {seed}: {type(error).__name__}: {str(error)[:300]}"


def run(call: Callable[[int], Profile], seeds: range) -> dict[str, Any]:
    """Every seed's call, CONCURRENT at once (as a server's users send them: the engine batches them)."""
    with ThreadPoolExecutor(CONCURRENT) as pool:
        outcomes = list(pool.map(lambda seed: outcome(call, seed), seeds))
    failures = [o for o in outcomes if o not in ("parsed", "cut")]
    return {"parsed": outcomes.count("parsed"), "cut": outcomes.count("cut"), "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the app's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    seeds = range(args.seeds)
    calls = {"langchain": langchain_call(args.url, args.model), "instructor": instructor_call(args.url, args.model)}
    # Both libraries at once: the engine batches their answers together (each runs to its token limit or end).
    with ThreadPoolExecutor(len(calls)) as pool:
        runs = {library: pool.submit(run, call, seeds) for library, call in calls.items()}
        results = {library: done.result() for library, done in runs.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
