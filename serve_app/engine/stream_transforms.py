"""Transforms of a vLLM SSE stream inside the model replica, before it goes to the front door.

Through a Serve handle each generator item is one message between Ray actors, and messages,
not bytes, are what cost: :func:`coalesce` joins chunks that are *already waiting* into one
item, and never waits for more (the first token leaves as soon as it exists, and under load
several tokens share a message).
:func:`end_on_error_event` makes an error event the stream's last, in the OpenAI
shape; :class:`OutcomeTap` reads how the stream ended as it passes.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from serve_app.errors import error_body
from serve_app.protocol import AnswerItem, Outcome, empty_kind, is_error_event


class _End:
    """Marks the end of the upstream generator inside :func:`coalesce`."""


_END = _End()


@dataclass(frozen=True)
class _Failure:
    exc: BaseException


async def coalesce(items: AsyncIterator[AnswerItem]) -> AsyncGenerator[AnswerItem, None]:
    """Yield every item of ``items``; SSE chunks that are already waiting go out as one (any other
    item, a whole answer or an outcome, goes out as it is, in its place).

    For an answer read through a Serve handle (another replica's front door), where each item is
    a message between Ray actors; the front door beside the engine reads the engine's items as
    they come (vLLM's own output queue already merges what a slow reader has not taken).
    A pump task reads ``items`` into a queue; each time the consumer asks, it
    gets everything queued so far, joined. No timer is involved. Closing this
    generator (the client left) cancels the pump, which cancels the upstream
    generator and so aborts the engine request.
    """
    queue: asyncio.Queue[AnswerItem | _End | _Failure] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
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
                if isinstance(item, _End | _Failure):
                    if batch:
                        yield "".join(batch)
                    if isinstance(item, _Failure):
                        raise item.exc
                    return
                if isinstance(item, str):
                    batch.append(item)
                else:
                    if batch:
                        yield "".join(batch)
                        batch = []
                    yield item
                if queue.empty():
                    break
                item = queue.get_nowait()
            if batch:
                yield "".join(batch)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


async def end_on_error_event(
    chunks: AsyncIterator[str], rewrite: Callable[[str], str] | None = None
) -> AsyncIterator[str]:
    """Make an error event the stream's last event, with the OpenAI error shape.

    vLLM's serving code reports a failure mid-stream as ``data: {"error": ...}``
    followed by ``data: [DONE]``. Here ``[DONE]`` means the answer is complete, so
    after an error it is dropped, and vLLM's error ``type`` is replaced by the
    OpenAI name for its status (or the event is replaced by ``rewrite``'s). Only
    error events are parsed; the cost per token is one prefix comparison.
    """
    async for chunk in chunks:
        if is_error_event(chunk):
            yield (rewrite or normalize_error_event)(chunk)
            return
        yield chunk


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
_FINISH_MARK = '"finish_reason":"'  # only a choice that finished has a string here (others: null)
_FINISH_REASON = re.compile(r'"finish_reason":"([a-z_]+)"')
# A delta's text that is not empty (chat's content, a completion's text), a tool call's start, and
# arguments that are not empty. (Inside a JSON string a quote is escaped, so these match keys only.)
_TEXT = re.compile(r'"(?:content|text)":"[^"]')
_TOOL_CALL_MARK = '"tool_calls":[{'
_ARGUMENTS = re.compile(r'"arguments":"[^"]')


@dataclass
class OutcomeTap:
    """Reads how a vLLM stream ended as it passes: the usage chunk and the finish reasons.

    The replica turns ``stream_options.include_usage`` on for every stream; a client
    that did not ask for the usage chunk does not receive it. The cost per chunk is
    two substring searches.
    """

    client_asked_usage: bool
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    wrote_text: bool = False
    called_tool: bool = False
    wrote_arguments: bool = False

    async def tap(self, chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        async for chunk in chunks:
            if not self.wrote_text and _TEXT.search(chunk):
                self.wrote_text = True
            if _TOOL_CALL_MARK in chunk:
                self.called_tool = True
                self.wrote_arguments = self.wrote_arguments or _ARGUMENTS.search(chunk) is not None
            if _FINISH_MARK in chunk:
                self.finish_reasons.extend(_FINISH_REASON.findall(chunk))
            if _USAGE_CHUNK_MARK in chunk and '"usage"' in chunk:
                self._read_usage(chunk)
                if not self.client_asked_usage:
                    continue
            yield chunk

    def _read_usage(self, chunk: str) -> None:
        try:
            usage = json.loads(chunk[len("data: ") :])["usage"]
            self.prompt_tokens = int(usage["prompt_tokens"])
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
        except (ValueError, KeyError, TypeError):
            pass

    @property
    def outcome(self) -> Outcome | None:
        """None until the usage chunk has passed (a stream cut short has none)."""
        if self.prompt_tokens is None:
            return None
        reasons = tuple(self.finish_reasons)
        empty = empty_kind(reasons, self.wrote_text, self.called_tool, self.wrote_arguments)
        return Outcome(self.prompt_tokens, self.completion_tokens, reasons, empty)
