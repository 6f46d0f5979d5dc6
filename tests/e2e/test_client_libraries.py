"""LangChain's and instructor's structured outputs against the CPU app, as their users call them.

tests/client_libraries.py runs in the libraries' own environment (.venv-clients, made by
``make test``) and asks each library for the report's pydantic model with 5 seeds, both at once:
every answer parses into the model (the libraries raise otherwise), except any cut by
the token limit, which the libraries refuse by its ``finish_reason``.
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
