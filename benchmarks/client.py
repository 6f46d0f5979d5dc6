"""One streamed request against an OpenAI-compatible server, timed as a client sees it."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.records import RequestRecord

FIRST_TOKEN_ID = 100  # prompts are token ids from here on: valid in any GLM-4 vocabulary, exact lengths


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}


@dataclass(frozen=True)
class Workload:
    """The same request, sent many times: fixed input and output lengths."""

    model: str
    input_tokens: int
    output_tokens: int
    endpoint: str = "completions"  # or "chat", or "responses": a text prompt of about input_tokens tokens

    def path(self) -> str:
        return PATHS[self.endpoint]

    def body(self) -> dict[str, Any]:
        if self.endpoint == "responses":  # OpenAI's Responses API: usage comes in its last event
            text = " ".join(["hello"] * self.input_tokens)
            return {"model": self.model, "input": text, "max_output_tokens": self.output_tokens} | {
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
        common = {
            "model": self.model,
            "max_tokens": self.output_tokens,
            "ignore_eos": True,  # exactly output_tokens tokens, whatever the model would say
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        if self.endpoint == "completions":
            return common | {"prompt": [FIRST_TOKEN_ID + i % 200 for i in range(self.input_tokens)]}
        return common | {"messages": [{"role": "user", "content": " ".join(["hello"] * self.input_tokens)}]}


RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def carries_tokens(event: dict[str, Any]) -> bool:
    """Whether a chunk carries generated tokens, for completions and chat chunks alike, or is a
    Responses API stream's text delta.

    Its text may be empty: a detokenizer holds back the bytes of an unfinished character
    (often, with random weights), but the token was generated and sent. A chat stream's
    first chunk, which only names the role, carries none.
    """
    if event.get("type") == "response.output_text.delta":
        return True
    for choice in event.get("choices") or ():
        if "text" in choice:
            return True
        delta = choice.get("delta")
        if delta and "role" not in delta:
            return True
    return False


async def sse_payloads(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE body, as they arrive.

    Events end with a blank line; splitting on it, not on line breaks, keeps a payload whole
    when its text holds U+2028 or other characters that ``str.splitlines`` (and so httpx's
    ``aiter_lines``) takes for line ends, which JSON leaves unescaped and noise text holds.
    An event may name itself first (``event: <type>``, the Responses API's).
    """
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *events, pending = pending.split("\n\n")
        for event in events:
            if event.startswith("event: "):
                event = event.partition("\n")[2]
            if event.startswith("data: "):
                yield event[len("data: ") :]


async def stream_once(client: httpx.AsyncClient, workload: Workload) -> RequestRecord:
    started = time.perf_counter()
    record = RequestRecord(ok=False)
    last_output: float | None = None
    try:
        async with client.stream("POST", workload.path(), json=workload.body()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"{response.status_code}: {body[:120]}"
                return record
            async for payload in sse_payloads(response):
                now = time.perf_counter()
                if payload == "[DONE]":
                    record.e2e_s = now - started
                    record.ok = record.ttft_s is not None
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"error event: {event['error'].get('message', '')[:120]}"
                    return record
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
                if event.get("type") in RESPONSE_ENDS:  # a Responses API stream's last event: no [DONE]
                    record.output_tokens = (event["response"].get("usage") or {}).get("output_tokens", 0)
                    record.e2e_s = now - started
                    record.ok = record.ttft_s is not None and event["type"] != "response.failed"
                    break
                if carries_tokens(event):
                    if last_output is None:
                        record.ttft_s = now - started
                    else:
                        record.gaps_s.append(now - last_output)
                    last_output = now
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:160]
    if record.e2e_s is None and record.error is None:
        record.error = "stream ended without [DONE]"
    return record
