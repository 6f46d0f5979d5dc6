"""What the response stores' tests write: responses, events and ids of their own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

OWNER, OTHER = "key-a", "key-b"


def response(response_id: str, status: str = "queued") -> dict:
    return {"id": response_id, "object": "response", "status": status, "output": []}


def event(kind: str, number: int) -> str:
    return f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{number}}}\n\n'


def unique(name: str) -> str:
    return f"resp_{name}_{id(object())}"


class ScriptedGeneration:
    """A Generation's surface (``start``, ``chunks``, ``error``, ``aclose``) over a script of events,
    ``before`` awaited ahead of each: the producer's logic around a real store."""

    def __init__(self, events: list[str], before: Callable[[int], Awaitable[None]]) -> None:
        self.events, self.before = events, before
        self.error = None
        self.yielded = 0
        self.closed = False

    async def start(self) -> str:
        return "began"

    async def chunks(self) -> AsyncIterator[str]:
        for number, text in enumerate(self.events):
            await self.before(number)
            self.yielded += 1
            yield text

    async def aclose(self) -> None:
        self.closed = True
