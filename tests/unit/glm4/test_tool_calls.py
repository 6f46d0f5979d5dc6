"""GLM-4 answer parsing, whole and streamed at every chunk boundary."""

from __future__ import annotations

import itertools

import pytest

from serve_app.glm4.tool_calls import (
    ParsedOutput,
    ToolCall,
    ToolCallStream,
    parse_output,
)

NAMES = {"get_weather", "get_time", "get"}

CASES: list[tuple[str, str, ParsedOutput]] = [
    ("plain text", "\nHello, world!", ParsedOutput("Hello, world!", ())),
    ("multi-line text", "\nline one\nline two\n", ParsedOutput("line one\nline two\n", ())),
    (
        "call",
        'get_weather\n{"city": "Beijing"}',
        ParsedOutput("", (ToolCall("get_weather", '{"city": "Beijing"}'),)),
    ),
    (
        "call with spacing and unicode",
        'get_weather \n  {"city":"北京","days":3}\n',
        ParsedOutput("", (ToolCall("get_weather", '{"city": "北京", "days": 3}'),)),
    ),
    ("name that prefixes others", "get\n{}", ParsedOutput("", (ToolCall("get", "{}"),))),
    (
        "name prefixed by others",
        'get_time\n{"tz": "UTC"}',
        ParsedOutput("", (ToolCall("get_time", '{"tz": "UTC"}'),)),
    ),
    ("unknown name", 'get_w\n{"a": 1}', ParsedOutput('get_w\n{"a": 1}', ())),
    ("text that starts like a name", "get the weather", ParsedOutput("get the weather", ())),
    ("text that is a name prefix", "get_wea", ParsedOutput("get_wea", ())),
    ("a name and nothing else", "get_weather", ParsedOutput("get_weather", ())),
    (
        "invalid JSON",
        'get_weather\n{"city": Beijing}',
        ParsedOutput('get_weather\n{"city": Beijing}', ()),
    ),
    ("truncated JSON", 'get_weather\n{"city": "Bei', ParsedOutput('get_weather\n{"city": "Bei', ())),
    ("JSON that is not an object", "get_weather\n[1, 2]", ParsedOutput("get_weather\n[1, 2]", ())),
    (
        "two calls",
        'get_weather\n{"city": "Paris"}<|assistant|>get_time\n{}',
        ParsedOutput("", (ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}"))),
    ),
    (
        "text then a call",
        '\nLet me check.<|assistant|>get_weather\n{"city": "Oslo"}',
        ParsedOutput("Let me check.", (ToolCall("get_weather", '{"city": "Oslo"}'),)),
    ),
    (
        "a call then a broken call",
        'get\n{}<|assistant|>get_time\n{"tz": ',
        ParsedOutput('get_time\n{"tz": ', (ToolCall("get", "{}"),)),
    ),
    ("separator-like text", "\na <| b <|assistant c", ParsedOutput("a <| b <|assistant c", ())),
    ("empty answer", "", ParsedOutput("", ())),
    ("only the metadata newline", "\n", ParsedOutput("", ())),
]


def stream_all(pieces: list[str], names=NAMES) -> ParsedOutput:
    stream = ToolCallStream(names)
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    return ParsedOutput(
        "".join(e for e in events if isinstance(e, str)),
        tuple(e for e in events if isinstance(e, ToolCall)),
    )


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_whole_answer(text: str, expected: ParsedOutput) -> None:
    assert parse_output(text, NAMES) == expected


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_chunking_gives_the_same_answer(text: str, expected: ParsedOutput) -> None:
    # Every split into two and three pieces, and one character at a time.
    for i in range(len(text) + 1):
        assert stream_all([text[:i], text[i:]]) == expected, f"split at {i}"
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert stream_all([text[:i], text[i:j], text[j:]]) == expected, f"split at {i}, {j}"
    assert stream_all(list(text)) == expected


def released_text(stream: ToolCallStream, piece: str) -> str:
    return "".join(e for e in stream.feed(piece) if isinstance(e, str))


def test_plain_text_streams_character_by_character() -> None:
    text = "\nThe answer is 42, not get_weather."
    stream = ToolCallStream(NAMES)
    released = ""
    for k, char in enumerate(text):
        released += released_text(stream, char)
        assert released == text[1 : k + 1]


def test_without_tools_nothing_is_held_back() -> None:
    stream = ToolCallStream((), separator=None)
    assert released_text(stream, "H") == "H"
    assert released_text(stream, "i <|") == "i <|"


def test_only_a_possible_function_name_is_held_back() -> None:
    stream = ToolCallStream(NAMES)
    assert released_text(stream, "ge") == ""
    assert released_text(stream, "t ") == ""  # "get " could still be the call "get"
    assert released_text(stream, "t") == "get t"  # no name has a space in it
    assert released_text(stream, "he") == "he"


def test_a_call_is_released_whole_when_its_turn_ends() -> None:
    stream = ToolCallStream(NAMES)
    assert stream.feed('get_weather\n{"city": ') == []
    assert stream.feed('"Rome"}') == []
    assert stream.feed("<|assistant|>") == [ToolCall("get_weather", '{"city": "Rome"}')]
    assert stream.finish() == []


def test_a_separator_split_across_pieces_is_not_released_as_text() -> None:
    stream = ToolCallStream(NAMES)
    assert released_text(stream, "\nok <|assis") == "ok "
    assert released_text(stream, "tant|>\nmore") == "more"


def test_without_a_separator_the_answer_is_one_turn() -> None:
    text = "get\n{}<|assistant|>get_time\n{}"
    assert parse_output(text, NAMES, separator=None) == ParsedOutput(text, ())
