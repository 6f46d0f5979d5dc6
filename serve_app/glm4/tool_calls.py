"""Reading GLM-4's answers: text, or function calls in GLM-4's own format.

GLM-4 writes every assistant turn as ``<|assistant|>{metadata}\\n{content}``.
For plain text the metadata is empty, so the answer starts with a newline; for
a function call the metadata is the function's name and the content its JSON
arguments::

    get_weather
    {"city": "Beijing"}

Several turns in one answer are separated by ``<|assistant|>``. This module is
pure text processing (no vLLM), so it is tested exhaustively on its own;
:mod:`serve_app.glm4.parser` plugs it into vLLM's OpenAI serving.

Streaming holds back only what could still change meaning: the first line of a
turn while it could still become a function's name, a call until its turn ends
(so malformed JSON can still come back as text), and a tail that could be the
start of a turn separator. Everything else is released as soon as it arrives.

Runs in each model replica, through :mod:`.parser`.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

TURN_SEPARATOR = "<|assistant|>"


@dataclass(frozen=True)
class ToolCall:
    """A complete, valid call: ``arguments`` is a JSON object's text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """What a whole answer amounts to: text for the user and calls to run."""

    content: str
    calls: tuple[ToolCall, ...]


Event = str | ToolCall
"""What a stream releases: a piece of text, or a finished call."""


def parse_output(text: str, tool_names: Collection[str], separator: str | None = TURN_SEPARATOR) -> ParsedOutput:
    """Split a complete answer into its text and its function calls."""
    stream = ToolCallStream(tool_names, separator)
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = tuple(e for e in events if isinstance(e, ToolCall))
    return ParsedOutput(content, calls)


def call_or_text(name_line: str, body: str, tool_names: Collection[str]) -> Event:
    """A turn that starts with a function's name: a call if its body is a JSON object."""
    name = name_line.strip()
    try:
        arguments = json.loads(body)
    except ValueError:
        arguments = None
    if name in tool_names and isinstance(arguments, dict):
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    return f"{name_line}\n{body}"


class ToolCallStream:
    """Incremental reader of one answer; feed it text as it is generated.

    Whatever the chunking, the events released add up to :func:`parse_output`
    of the whole text. With ``separator=None`` an answer is one turn (used when
    special tokens are not in the text, so a separator cannot be seen).
    """

    def __init__(self, tool_names: Collection[str], separator: str | None = TURN_SEPARATOR):
        self.tool_names = frozenset(tool_names)
        self.separator = separator
        self._pending = ""
        self._state = "head"  # "head": first line of a turn; "text"; "call"
        self._name_line = ""

    def feed(self, text: str) -> list[Event]:
        """Take the next piece of the answer; return what can be released now."""
        self._pending += text
        events: list[Event] = []
        while self._step(events):
            pass
        return [e for e in events if e != ""]

    def finish(self) -> list[Event]:
        """The answer ended: release everything still held back."""
        events: list[Event] = []
        if self._state == "call":
            events.append(call_or_text(self._name_line, self._pending, self.tool_names))
        else:
            events.append(self._pending)
        self._pending, self._state = "", "head"
        return [e for e in events if e != ""]

    def _find_separator(self) -> int:
        return self._pending.find(self.separator) if self.separator else -1

    def _end_turn(self, at: int) -> None:
        self._pending = self._pending[at + len(self.separator or "") :]
        self._state = "head"

    def _step(self, events: list[Event]) -> bool:
        """Advance the state machine once; False when it needs more text."""
        pending, sep_at = self._pending, self._find_separator()
        if self._state == "head":
            newline_at = pending.find("\n")
            if sep_at >= 0 and (newline_at < 0 or sep_at < newline_at):
                events.append(pending[:sep_at])  # a one-line turn is text
                self._end_turn(sep_at)
            elif newline_at >= 0:
                head = pending[:newline_at]
                if head == "":  # empty metadata: a text turn
                    self._pending, self._state = pending[1:], "text"
                elif head.strip() in self.tool_names:
                    self._name_line = head
                    self._pending, self._state = pending[newline_at + 1 :], "call"
                else:
                    self._state = "text"
            elif not self._could_be_name(pending):
                self._state = "text"
            else:
                return False
            return True
        if self._state == "text":
            if sep_at >= 0:
                events.append(pending[:sep_at])
                self._end_turn(sep_at)
                return True
            held_back = self._separator_prefix_len(pending)
            events.append(pending[: len(pending) - held_back])
            self._pending = pending[len(pending) - held_back :]
            return False
        # state "call": the call ends with its turn
        if sep_at >= 0:
            events.append(call_or_text(self._name_line, pending[:sep_at], self.tool_names))
            self._end_turn(sep_at)
            return True
        return False

    def _could_be_name(self, first_line: str) -> bool:
        """Whether an unfinished first line may still turn out to be a name."""
        if first_line == "":
            return True
        started = first_line.lstrip()
        word = started.rstrip()
        if word != started:  # whitespace after the word: only a whole name may follow
            return word in self.tool_names
        return any(name.startswith(word) for name in self.tool_names)

    def _separator_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that starts a separator."""
        if not self.separator:
            return 0
        for length in range(min(len(self.separator) - 1, len(text)), 0, -1):
            if self.separator.startswith(text[-length:]):
                return length
        return 0
