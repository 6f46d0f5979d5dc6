"""LangChain's and instructor's structured outputs, and an OpenAI Agents SDK agent with a function
tool, against the CPU app, as their users call them.

tests/client_libraries.py runs in the libraries' own environment (.venv-clients, made by
``make test``) and asks each library for the report's pydantic model with 5 seeds, both at once:
every answer parses into the model (the libraries raise otherwise), except any cut by
the token limit, which the libraries refuse by its ``finish_reason``. tests/agents_sdk.py runs
an agent on the Agents SDK's default provider, which calls the Responses API.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
# Each library's answers (the report's 30 are test_structured_outputs.py's, over the plain API): enough
# for the libraries' own parsing; each runs to its end or the token limit on the CPU engine.
SEEDS = 5


async def test_langchain_and_instructor_parse_every_structured_answer(app):
    assert CLIENTS_PYTHON.exists(), f"{CLIENTS_PYTHON} not found: `make test` (or `make .venv-clients/.installed`)"
    command = [str(CLIENTS_PYTHON), str(ROOT / "tests" / "client_libraries.py")]
    command += ["--url", f"{app.url}/v1", "--model", app.model, "--seeds", str(SEEDS)]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    print(results)
    for library, result in results.items():
        assert result["failures"] == [], library
        assert result["parsed"] + result["cut"] == SEEDS and result["parsed"] > 0, (library, result)


async def test_an_agents_sdk_agent_calls_its_tool_and_answers_through_the_responses_api(app):
    """The SDK's default provider (OpenAI's Responses API): a forced call of the tool, which the
    SDK runs; its output sent back as an input item; a second response, the agent's structured
    output, ends the run."""
    assert CLIENTS_PYTHON.exists(), f"{CLIENTS_PYTHON} not found: `make test` (or `make .venv-clients/.installed`)"
    command = [str(CLIENTS_PYTHON), str(ROOT / "tests" / "agents_sdk.py"), "--url", f"{app.url}/v1"]
    done = await asyncio.to_thread(
        subprocess.run, [*command, "--model", app.model], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout.splitlines()[-1])
    assert len(run["calls"]) == 1, run  # (its argument is the random model's text, valid for the schema)
    assert run["items"] == ["tool_call_item", "tool_call_output_item", "message_output_item"], run
    assert len(run["responses"]) == 2 and all(r.startswith("resp_") for r in run["responses"]), run
    assert set(run["final_output"]) == {"summary"} and len(run["final_output"]["summary"]) <= 20, run
