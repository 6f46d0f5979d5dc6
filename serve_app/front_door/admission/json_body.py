"""A request's body as a JSON object, decoded within bounds that keep parsing cheap.

The front door decodes every body here, and the ReplicaPicker (which runs no vLLM code: this
module imports none) holds a body to the same bounds before it parses one for routing.

Runs in each model replica and in each ReplicaPicker replica.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from serve_app.errors import APIError, quoted

MAX_NESTING = 64  # far above any real request (tool schemas included); far below the parser's limits
MAX_CONTAINERS = 100_000  # arrays and objects in one body: a long conversation with tools has thousands


def decode_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: UTF-8, not absurdly nested, an object."""
    if not raw:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING:  # only then can it nest too deeply
        check_structure(raw)
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # Python's own limit on integer literals (4300 digits)
        raise APIError(400, "the request body holds a number with too many digits") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _finite_float(literal: str) -> float:
    """A JSON number as a float; ``1e999`` would become infinity, which JSON cannot express."""
    value = float(literal)
    if math.isinf(value):
        raise APIError(400, f"the request body holds a number too large for a float: {quoted(literal)}")
    return value


def _reject_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's parser accepts them by default)."""
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON value")


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_ONLY_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as int8: +1 opens, -1 closes
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[{]}")


def structure(raw: bytes) -> tuple[int, int]:
    """How deep arrays and objects nest in a JSON text, and how many there are (strings do not count).

    Linear and in compiled code: a regular expression removes the strings, the
    openers are counted, and only when there are few enough does numpy sum the
    brackets for the depth. 8 MB of brackets take milliseconds, where a Python
    loop over the characters took seconds and stalled every stream on the replica.
    """
    outside_strings = _JSON_STRING.sub(b"", raw)
    containers = outside_strings.count(b"[") + outside_strings.count(b"{")
    if containers > MAX_CONTAINERS:
        return 0, containers  # refused for their number; their depth need not be known
    steps = np.frombuffer(outside_strings.translate(_ONLY_BRACKETS, _NOT_BRACKETS), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0)), containers


def check_structure(raw: bytes) -> None:
    """400 when arrays and objects nest deeper than MAX_NESTING, or number more than MAX_CONTAINERS.

    The second bound keeps parsing bounded: Python's JSON parser needs about a
    second per million empty arrays, time no real request needs.
    """
    depth, containers = structure(raw)
    if containers > MAX_CONTAINERS:
        raise APIError(400, f"the request body holds more than {MAX_CONTAINERS} arrays and objects")
    if depth > MAX_NESTING:
        raise APIError(400, f"the request body nests arrays and objects deeper than {MAX_NESTING} levels")
