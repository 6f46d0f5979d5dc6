"""Bounds on what a client names and the server echoes back or keeps: ids, positions in a log,
and the Responses API's ``metadata`` and ``user``.

An id a client sends (a stored response's, a kept answer's, a ``Stream`` request's) is quoted in
errors, sent to the store as part of a key, and a ``Stream`` request's id is copied into every
response of its request and every entry of a kept answer's log: each is at most
:data:`MAX_ID_CHARS`. A position (``starting_after``, ``after_index``) is a number a log can
hold. The Responses API's ``metadata`` is bounded as OpenAI bounds it (16 pairs, keys of 64
characters, values of 512), and ``user`` and the like at 512 characters: each is echoed in the
response object, which is kept. Past a bound: 400 naming the parameter, before the store is asked;
an id of another shape than the server gives what it stores (:func:`names_stored`) is a 404.

Runs in each model replica (and its checker process, for a large body).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from serve_app.errors import APIError

MAX_ID_CHARS = 128  # the server's own ids are 36 (resp_ and 32 hex digits; ans_ and 32)
MAX_POSITION = 2**62  # a log's sequence numbers and indexes stay below it (Redis's stream ids are 64-bit)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds
MAX_LABEL_CHARS = 512
LABELS = ("user", "safety_identifier", "prompt_cache_key")  # strings a Responses body may send, echoed or kept


# The ids the server gives what it stores (admission/validation.py, grpc_api/stored_answers.py).
STORED_ID = re.compile(r"(resp|ans)_[0-9a-f]{32}")


def names_stored(value: str) -> bool:
    """Whether ``value`` has the shape of an id the server gives a stored response or answer: any
    other is stored nowhere (the door answers 404 without asking the store, whose keys it could name)."""
    return STORED_ID.fullmatch(value) is not None


def checked_id(value: str, param: str) -> str:
    """``value``, a client's id of something, if within :data:`MAX_ID_CHARS`; else 400 naming ``param``."""
    if len(value) > MAX_ID_CHARS:
        raise APIError(400, f"{param} is {len(value)} characters; an id is at most {MAX_ID_CHARS}", param=param)
    return value


def checked_position(value: int, param: str) -> int:
    """``value``, a position in a log (-1: before its first entry), if a log can hold it; else 400."""
    if not -1 <= value < MAX_POSITION:
        raise APIError(400, f"{param} must be from -1 to {MAX_POSITION - 1}", param=param)
    return value


def check_responses_echoed(body: Mapping[str, Any]) -> None:
    """400 for a Responses body's ``metadata`` or label past its bound (the response echoes them)."""
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        if len(metadata) > METADATA_PAIRS:
            raise APIError(400, f"metadata has {len(metadata)} pairs; at most {METADATA_PAIRS}", param="metadata")
        for key, value in metadata.items():
            if len(str(key)) > METADATA_KEY_CHARS:
                raise APIError(400, f"a metadata key is at most {METADATA_KEY_CHARS} characters", param="metadata")
            if isinstance(value, str) and len(value) > METADATA_VALUE_CHARS:
                raise APIError(
                    400, f"a metadata value is at most {METADATA_VALUE_CHARS} characters", param=f"metadata.{key}"
                )
    for name in LABELS:
        value = body.get(name)
        if isinstance(value, str) and len(value) > MAX_LABEL_CHARS:
            raise APIError(400, f"{name} is {len(value)} characters; at most {MAX_LABEL_CHARS}", param=name)
    previous = body.get("previous_response_id")
    if isinstance(previous, str):
        checked_id(previous, "previous_response_id")
