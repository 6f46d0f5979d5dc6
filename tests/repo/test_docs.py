"""Every command in the README and docs/ is run by a test or CI, or says it needs a GPU or a cluster."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.doc_blocks import ROOT, block_starting, blocks

COMMANDS = ("sh", "bash", "python", "console")
MARKS = ("needs a gpu", "need a gpu", "needs a cluster", "need a cluster")

# Blocks that tests or CI run, by their document and first line: what runs them.
RUN_BY = {
    ("README.md", "make serve"): "CI runs `make test`; `make serve`'s config and ready line run in tests/e2e "
    "(conftest.py serves deploy/config.cpu.yaml, test_local_setup.py runs tools.ready_line)",
    ("README.md", "export RAY_AUTH_MODE=token"): "tests/e2e/test_local_setup.py (serve status, ray status)",
    ("README.md", "curl -N"): "tests/e2e/test_docs.py",
    ("README.md", "from openai import OpenAI"): "tests/e2e/test_docs.py",
    ("README.md", "import openai"): "tests/e2e/test_docs.py",
    ("docs/performance-history.md", ".venv/bin/python -c"): "tests/repo/test_docs.py",
    ("docs/grpc.md", "import asyncio"): "tests/e2e/test_docs.py",
    ("docs/grpc.md", '"""Three haikus'): "tests/e2e/test_docs.py",
}


def test_every_command_block_is_run_by_a_test_or_marked():
    unaccounted = []
    for block in blocks():
        if block.language not in COMMANDS:
            continue
        run = any(block.doc == doc and block.first_line.startswith(first) for doc, first in RUN_BY)
        marked = any(mark in block.before.lower() for mark in MARKS)
        if not (run or marked):
            unaccounted.append(f"{block.doc}: {block.first_line}")
    assert unaccounted == [], "run these in a test (RUN_BY) or say they need a GPU or a cluster"


@pytest.mark.parametrize(("doc", "first_line"), sorted(RUN_BY))
def test_every_block_said_to_be_run_exists(doc, first_line):
    assert block_starting(doc, first_line).language in COMMANDS


def test_the_body_check_timing_command_runs():
    """performance-history.md's command that times the check of an 8 MB body of brackets."""
    command = block_starting("docs/performance-history.md", ".venv/bin/python -c").text
    argv = ["bash", "-c", command.replace(".venv/bin/python", sys.executable, 1)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refusal, took = done.stdout.splitlines()
    assert refusal.startswith("400 ") and "more than 100000 arrays and objects" in refusal
    assert took.endswith(" ms") and took.split()[0].isdigit(), took
