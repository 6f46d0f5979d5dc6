"""Large request bodies are parsed and validated in a separate process.

Parsing megabytes of JSON and validating it with vLLM's request model takes
tens to hundreds of milliseconds of pure-Python and compiled code that holds the
GIL, so a worker thread does not help: every stream the ingress replica relays
stops while it runs. A body above :data:`LARGE_BODY_BYTES` therefore goes to a
checker process (one per ingress replica, started on the first such body) and
comes back small: the few fields the ingress still checks, and the validated
request already pickled, which the ingress hands to a model replica without
unpickling it (:class:`serve_app.protocol.PickledRequest`).

At most :data:`MAX_WAITING` large bodies are checked or waiting per ingress
replica; more are refused with 429, so a flood of them holds bounded memory and
delays only itself.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from serve_app.errors import APIError
from serve_app.ingress.request_cost import BodySize, measure
from serve_app.ingress.validation import decode_body, parse_request
from serve_app.protocol import PickledRequest

logger = logging.getLogger("ray.serve")

LARGE_BODY_BYTES = 256 * 1024  # smaller bodies take well under a millisecond or two: checked in line
MAX_WAITING = 8  # large bodies being checked or waiting, per ingress replica
# What the ingress checks after validation (routing, output ceiling, choices, extensions), copied out of the
# body; what the rest costs is measured there (serve_app.ingress.request_cost.measure).
CHECKED_FIELDS = (
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "use_beam_search",
    "priority",
)


@dataclass(frozen=True)
class CheckedBody:
    """What the checker sends back: the fields the ingress still needs, what the body's costs depend
    on (measured there), and the request."""

    fields: dict[str, Any]
    request: PickledRequest
    size: BodySize


ToJSON = Callable[[bytes], bytes]  # a request's bytes as the HTTP API's JSON (a gRPC message's); picklable


def check_body(request_model: type[BaseModel], raw: bytes, to_json: ToJSON | None = None) -> CheckedBody | APIError:
    """In the checker process: :func:`decode_body` (of ``to_json(raw)`` if given) and
    :func:`parse_request`, answered small.

    An :class:`APIError` is returned, not raised, so it crosses the process
    boundary as the value it is.
    """
    try:
        body = decode_body(raw if to_json is None else to_json(raw))
        payload = parse_request(request_model, body)
    except APIError as exc:
        return exc
    request = PickledRequest(
        pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL),
        payload.request_id,
        bool(payload.stream),
    )
    return CheckedBody({name: body[name] for name in CHECKED_FIELDS if name in body}, request, measure(body))


def _import_request_models() -> None:
    """Run once in a new checker process, so its first body does not wait for vLLM's imports."""
    import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401


class BodyChecker:
    """The ingress replica's checker process, restarted if it dies.

    ``check`` is :func:`check_body` and ``warm`` imports what it needs, unless a test swaps them.
    """

    def __init__(
        self,
        check: Callable[[type[BaseModel], bytes, ToJSON | None], CheckedBody | APIError] = check_body,
        warm: Callable[[], None] | None = _import_request_models,
    ) -> None:
        self._check = check
        self._warm = warm
        self._pool: ProcessPoolExecutor | None = None
        self._waiting = 0

    async def check(self, request_model: type[BaseModel], raw: bytes, to_json: ToJSON | None = None) -> CheckedBody:
        """The checked body, or the :class:`APIError` a client gets (400, 429, 500)."""
        if self._waiting >= MAX_WAITING:
            raise APIError(
                429,
                f"this server is already checking {MAX_WAITING} large request bodies; retry shortly",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self._waiting += 1
        try:
            pool = self._pool or self._start()
            result = await asyncio.wrap_future(pool.submit(self._check, request_model, raw, to_json))
        except BrokenProcessPool:
            logger.error("the request body checker process died; starting another")
            self._pool = None
            raise APIError(500, "the request body could not be checked", code="internal_error") from None
        finally:
            self._waiting -= 1
        if isinstance(result, APIError):
            raise result
        return result

    def _start(self) -> ProcessPoolExecutor:
        # spawn, not fork: the ingress process runs threads (Ray's, the readiness watch).
        self._pool = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=self._warm
        )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
