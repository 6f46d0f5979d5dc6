"""What flows from a model replica to the ingress, and how it is batched.

A replica answers every call with an async generator. Its first item decides the
HTTP answer: a :class:`Reply` (a complete JSON body with its status: a unary
response or an error found before any token) or the first piece of an SSE
stream, already framed as ``data: ...\\n\\n`` by vLLM's serving code. The ingress
writes those bytes to the socket as they are: nothing is re-encoded per token.

Each generator item is one message between Ray actors, and messages, not bytes,
are what cost. :func:`coalesce` therefore joins chunks that are *already
waiting* into one item, and never waits for more: the first token leaves as soon
as it exists, and under load several tokens share a message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serve_app.errors import error_body

DONE_EVENT = "data: [DONE]\n\n"
_ERROR_EVENT_PREFIX = 'data: {"error"'


@dataclass(frozen=True)
class Usage:
    """Tokens an answer used, reported by the replica for per-key token limits.

    A stream's last generator item when the ingress asked for it; never written to the client.
    """

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Reply:
    """A complete (non-streamed) answer: HTTP status and JSON body."""

    status: int
    body: bytes
    usage: Usage | None = None

    @classmethod
    def error(cls, status: int, message: str, param: str | None = None, code: str | None = None) -> Reply:
        return cls(status, json.dumps(error_body(status, message, param, code)).encode())


class _End:
    """Marks the end of the upstream generator inside :func:`coalesce`."""


_END = _End()


@dataclass(frozen=True)
class _Failure:
    exc: BaseException


async def coalesce(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield every chunk of ``chunks``; chunks that are already waiting go out as one.

    A pump task reads ``chunks`` into a queue; each time the consumer asks, it
    gets everything queued so far, joined. No timer is involved. Closing this
    generator (the client left) cancels the pump, which cancels the upstream
    generator and so aborts the engine request.
    """
    queue: asyncio.Queue[str | _End | _Failure] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
        except Exception as exc:  # delivered to the consumer, which re-raises it
            queue.put_nowait(_Failure(exc))
        finally:
            queue.put_nowait(_END)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            item = await queue.get()
            batch: list[str] = []
            while True:
                if isinstance(item, _End):
                    if batch:
                        yield "".join(batch)
                    return
                if isinstance(item, _Failure):
                    if batch:
                        yield "".join(batch)
                    raise item.exc
                batch.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            yield "".join(batch)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


async def end_on_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Make an error event the stream's last event, with the OpenAI error shape.

    vLLM's serving code reports a failure mid-stream as ``data: {"error": ...}``
    followed by ``data: [DONE]``. Here ``[DONE]`` means the answer is complete, so
    after an error it is dropped, and vLLM's error ``type`` is replaced by the
    OpenAI name for its status. Only error events are parsed; the cost per token
    is one prefix comparison.
    """
    async for chunk in chunks:
        if is_error_event(chunk):
            yield normalize_error_event(chunk)
            return
        yield chunk


def is_error_event(chunk: str) -> bool:
    return chunk.startswith(_ERROR_EVENT_PREFIX)


def normalize_error_event(chunk: str) -> str:
    """Rewrite one vLLM ``data: {"error": ...}`` event into this server's error shape."""
    try:
        info = json.loads(chunk[len("data: ") :])["error"]
        status = int(info.get("code") or 500)
        body = error_body(status, str(info.get("message", "")), info.get("param"))
    except (ValueError, KeyError, TypeError):
        body = error_body(500, "the stream failed")
    return "data: " + json.dumps(body) + "\n\n"


_USAGE_CHUNK_MARK = '"choices":[]'  # vLLM's final usage chunk, and no other chunk, has no choices


@dataclass
class UsageTap:
    """Takes the final usage chunk out of a vLLM stream, keeping it for the client only if it asked.

    The replica turns ``stream_options.include_usage`` on when the ingress needs the
    counts (per-key token limits); a client that did not ask for the usage chunk
    must not receive it. The cost per chunk is one substring search.
    """

    client_asked: bool
    usage: Usage | None = None

    async def tap(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        async for chunk in chunks:
            if _USAGE_CHUNK_MARK in chunk and '"usage"' in chunk:
                self.usage = read_usage(chunk) or self.usage
                if not self.client_asked:
                    continue
            yield chunk


def read_usage(chunk: str) -> Usage | None:
    """The usage of one ``data: {...}`` event, or None if it has none."""
    try:
        usage = json.loads(chunk[len("data: ") :])["usage"]
        return Usage(int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0))
    except (ValueError, KeyError, TypeError):
        return None
