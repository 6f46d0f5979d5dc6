"""The README's calls and docs/grpc.md's client, run as written against the running app (only its address differs)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from tests.doc_blocks import block_starting

README_URL = "http://127.0.0.1:8000"
GRPC_DOC_TARGET = "localhost:9000"


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


async def test_the_readmes_curl_streams_an_answer_with_its_usage(app):
    command = block_starting("README.md", "curl -N").text.replace(README_URL, app.url)
    done = await asyncio.to_thread(run, ["bash", "-c", command])
    assert done.returncode == 0, done.stderr
    events = [line[6:] for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    # max_tokens, or one of GLM-4's stop tokens before it (the tiny model's 384-token vocabulary
    # makes one likely enough that the text itself may be empty).
    assert 0 < chunks[-1]["usage"]["completion_tokens"] <= 64
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


# Run around the README's snippet: the SDK's stream iterator records each chunk it yields, and
# the chunks' text and last finish reason are printed after the snippet's own output.
COUNTING_PROLOGUE = """
import openai
_chunks = []
_iterate = openai.Stream.__iter__
def _recording(self):
    for _chunk in _iterate(self):
        _chunks.append(_chunk)
        yield _chunk
openai.Stream.__iter__ = _recording
"""
COUNTING_EPILOGUE = """
import json
_text = "".join(c.choices[0].delta.content or "" for c in _chunks if c.choices)
_reasons = [c.choices[0].finish_reason for c in _chunks if c.choices and c.choices[0].finish_reason]
print("\\n" + json.dumps({"chunks": len(_chunks), "text": _text, "finish": _reasons}))
"""


async def test_the_readmes_openai_client_streams_an_answer_without_error(app):
    code = block_starting("README.md", "from openai import OpenAI").text.replace(README_URL, app.url)
    done = await asyncio.to_thread(run, [sys.executable, "-c", COUNTING_PROLOGUE + code + COUNTING_EPILOGUE])
    assert done.returncode == 0 and done.stderr == "", done.stderr  # the SDK met nothing it could not parse
    printed, _, record = done.stdout.rstrip("\n").rpartition("\n")
    streamed = json.loads(record)
    # It streamed an answer (the role's chunk, then tokens) that ended once, and printed its text
    # as it came (the tiny model's noise, empty when its first token is a stop token).
    assert streamed["chunks"] >= 2 and streamed["finish"] in (["stop"], ["length"]), streamed
    as_read = streamed["text"].replace("\r\n", "\n").replace("\r", "\n")  # (text mode's newlines)
    assert printed == as_read, (printed, streamed)


# Printed on the line after the README's Responses snippet's own output: what its responses say of themselves.
RESPONSE_EPILOGUE = """
import json
print()
_job = client.responses.retrieve(job.id)
_said = {"status": response.status, "tokens": response.usage.output_tokens, "text": response.output_text,
         "continued": more.previous_response_id, "id": response.id, "job": _job.output_text, "job_status": _job.status}
print(json.dumps(_said))
"""


def as_printed(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")  # (text mode's newlines)


async def test_the_readmes_responses_calls_print_their_answers_text(app):
    """The answer's text, then a background answer's, read as a stream of its events; the
    conversation continued from the first."""
    code = block_starting("README.md", "import openai").text.replace(README_URL, app.url)
    done = await asyncio.to_thread(run, [sys.executable, "-c", code + RESPONSE_EPILOGUE])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    printed, _, record = done.stdout.rstrip("\n").rpartition("\n")
    said = json.loads(record)
    assert said["status"] in ("completed", "incomplete") and 0 < said["tokens"] <= 64, said
    assert said["continued"] == said["id"] and said["job_status"] in ("completed", "incomplete"), said
    assert printed == as_printed(said["text"]) + "\n" + as_printed(said["job"]), (printed, said)


async def test_the_grpc_docs_client_streams_an_answer_and_its_final_response(app):
    code = block_starting("docs/grpc.md", "import asyncio").text.replace(GRPC_DOC_TARGET, app.grpc_target)
    done = await asyncio.to_thread(run, [sys.executable, "-c", code])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # The final response's line: a finish reason and the tokens (the tiny model may stop early).
    *_, reason, count, unit = done.stdout.split()
    assert reason in ("stop", "length") and 0 < int(count) <= 64 and unit == "tokens", done.stdout
    assert "failed:" not in done.stdout


async def test_the_grpc_docs_multiplexed_client_cancels_one_request_and_resumes_the_kept_one(app):
    """docs/grpc.md's Stream example: two haikus end (stop or length), the third is cancelled (or its
    cancel is rejected, had it ended first), and Resume reads the kept one's text again, whole."""
    code = block_starting("docs/grpc.md", '"""Three haikus').text.replace(GRPC_DOC_TARGET, app.grpc_target)
    done = await asyncio.to_thread(run, [sys.executable, "-c", code])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for n in (0, 1):
        outcome, _ = lines[f"haiku-{n}"].split(" ", 1)
        assert outcome in ("stop", "length"), done.stdout
    assert lines["haiku-2"].split(" ", 1)[0] in ("cancelled", "rejected:"), done.stdout
    answer_id, resumed = lines["resumed"].split(" ", 1)
    assert answer_id.startswith("ans_") and resumed == lines["haiku-0"].split(" ", 1)[1], done.stdout
