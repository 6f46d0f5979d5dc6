"""Reading Server-Sent Events the way an OpenAI client does, strictly."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    events: list[str] = field(default_factory=list)  # raw `data:` payloads, in order
    # When this stream's first and last bytes of body arrived, as places in RECEIVED's order.
    first_received: int | None = None
    last_received: int | None = None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def parse_events(text: str) -> list[str]:
    """Split an SSE body into `data:` payloads; fail on anything OpenAI would not send."""
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-80:]!r}"
    payloads = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), f"not a data event: {block[:80]!r}"
        assert "\n" not in block, f"multi-line event: {block[:80]!r}"
        payloads.append(block[len("data: ") :])
    return payloads


RECEIVED = itertools.count()  # numbers every piece of body any stream of this process receives


async def post_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Stream:
    """POST and read the whole stream, noting when its first and last pieces arrived (see RECEIVED)."""
    async with client.stream("POST", path, json=body) as response:
        stream = Stream(response.status_code, response.headers)
        pieces = []
        async for piece in response.aiter_bytes():
            stream.last_received = next(RECEIVED)
            if stream.first_received is None:
                stream.first_received = stream.last_received
            pieces.append(piece)
        if response.status_code == 200:
            stream.events = parse_events(b"".join(pieces).decode())
        return stream
