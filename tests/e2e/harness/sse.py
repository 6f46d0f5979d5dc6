"""Reading Server-Sent Events the way an OpenAI client does, strictly."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from serve_app.front_door.core.stream_watch import KEEPALIVE


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    events: list[str] = field(default_factory=list)  # raw `data:` payloads, in order

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def parse_events(text: str) -> list[str]:
    """Split an SSE body into `data:` payloads; fail on anything OpenAI would not send. A comment
    (`: keep-alive`, sent while an answer has not begun) is skipped, as SSE and OpenAI's SDK skip it."""
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-80:]!r}"
    payloads = []
    for block in text[:-2].split("\n\n"):
        if block + "\n\n" == KEEPALIVE:
            continue
        assert block.startswith("data: "), f"not a data event: {block[:80]!r}"
        assert "\n" not in block, f"multi-line event: {block[:80]!r}"
        payloads.append(block[len("data: ") :])
    return payloads


async def post_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Stream:
    """POST and read the whole stream."""
    async with client.stream("POST", path, json=body, headers=headers) as response:
        stream = Stream(response.status_code, response.headers)
        body_bytes = await response.aread()
        if response.status_code == 200:
            stream.events = parse_events(body_bytes.decode())
        return stream
