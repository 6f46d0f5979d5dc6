"""Large request bodies are parsed and validated in a separate process.

Parsing megabytes of JSON and validating it with vLLM's request model takes
tens to hundreds of milliseconds of pure-Python and compiled code that holds the
GIL, so a worker thread does not help: every stream the model replica serves
stops while it runs. A body above :data:`LARGE_BODY_BYTES` therefore goes to a
checker process (one per model replica, started on the first such body) and
comes back small: the few fields the front door still checks, and the validated
request already pickled, which the front door hands to the engine without
unpickling it (:class:`serve_app.protocol.PickledRequest`).

The same process builds every request's structured-output grammar first, under a
time limit (:mod:`serve_app.front_door.admission.grammar_build`): one job runs at a time, so the
limit counts only the build, and a build past it costs the process, which is killed
and started again. Each checker is forked from a forkserver that has imported vLLM's
request models and grammar backend once (:data:`CHECKER_PRELOAD`): a killed checker is
replaced in well under a second, where a fresh process spends seconds of CPU importing
vLLM again, so a grammar past its limit costs the replica its limit and little more.

At most :data:`MAX_WAITING` large bodies and :data:`MAX_WAITING_GRAMMARS` grammars are
checked or waiting per model replica, and one API key holds at most half of either; more are
refused with 429, so a flood of them holds bounded memory and delays only large bodies and
grammars. The turns at the process go round the keys (:mod:`serve_app.front_door.admission.checker_turns`):
one key's costly specs delay another key's job by at most one of theirs.

Runs in each model replica, and in the checker process each model replica starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from serve_app.errors import APIError
from serve_app.front_door.admission.checker_turns import TakeTurns
from serve_app.front_door.admission.grammar_build import build_grammar
from serve_app.front_door.admission.grammar_build import warm_up as warm_up_grammars
from serve_app.front_door.admission.json_body import decode_body
from serve_app.front_door.admission.request_cost import BodySize, measure
from serve_app.front_door.admission.validation import parse_request
from serve_app.front_door.telemetry.record import GRAMMAR_TOO_COSTLY, INVALID_GRAMMAR
from serve_app.protocol import PickledRequest

logger = logging.getLogger("ray.serve")

LARGE_BODY_BYTES = 256 * 1024  # smaller bodies take well under a millisecond or two: checked in line
MAX_WAITING = 8  # large bodies being checked or waiting, per model replica
# Grammars being built or waiting, per model replica: small jobs (milliseconds, at most a time limit),
# as many as structured-output requests arrive, all waiting for the process on its first start.
MAX_WAITING_GRAMMARS = 64
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time
CPU_POLL_S = 0.02  # how often a job's CPU time is read against its limit
WALL_BACKSTOP = 10  # a job's wall-clock limit, in times its CPU-time limit
# What every checker imports before its first job: the forkserver imports these once per replica.
CHECKER_PRELOAD = (
    "serve_app.front_door.admission.large_bodies",
    "serve_app.vllm_internals",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.completion.protocol",
    "vllm.entrypoints.openai.responses.protocol",
)
# What the front door checks or uses after validation (routing, output ceiling, choices, extensions, the
# client's cache salt), copied out of the body; what the rest costs is measured there
# (serve_app.front_door.admission.request_cost.measure).
CHECKED_FIELDS = (
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "use_beam_search",
    "priority",
    "cache_salt",
)


@dataclass(frozen=True)
class StoredParts:
    """What the Responses API's stored and background answers read of a request, beside what the engine
    gets: the request (its flags, the object a background answer is kept as; its ``input`` emptied when
    it was checked in the checker process) and its input as the items a later turn's history keeps
    (None: made from the request when needed)."""

    request: Any  # vLLM's ResponsesRequest
    input_items: list[Any] | None = None


@dataclass(frozen=True)
class CheckedBody:
    """What the checker sends back: the fields the front door still needs, what the body's costs depend
    on (measured there), and the request (with a Responses request, its stored parts, pickled)."""

    fields: dict[str, Any]
    request: PickledRequest
    size: BodySize
    stored: bytes | None = None  # a pickled StoredParts


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
    fields = {name: body[name] for name in CHECKED_FIELDS if name in body}
    return CheckedBody(fields, request, measure(body), stored_parts(payload))


def stored_parts(payload: Any) -> bytes | None:
    """A Responses request's :class:`StoredParts`, made here (its input's items dumped as JSON, in
    time that grows with them) and pickled small; None for any other request."""
    if not hasattr(payload, "previous_response_id"):
        return None
    from serve_app.front_door.answer_log.history import request_input_items

    parts = StoredParts(payload.model_copy(update={"input": []}), request_input_items(payload))
    return pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)


def _warm_up() -> None:
    """Run once in a new checker process, so its first body or grammar does not wait for vLLM's imports."""
    import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401

    warm_up_grammars()


def checker_context() -> multiprocessing.context.BaseContext:
    """Python's forkserver, preloaded with :data:`CHECKER_PRELOAD`. Not a fork of the replica itself,
    which runs threads (Ray's, the readiness watch): the forkserver starts as a fresh process, as
    spawn would, and forks only itself."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(CHECKER_PRELOAD))  # read when the forkserver first starts
    return context


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system, every thread) process ``pid`` has used, from ``/proc``; None
    once it is gone (the pool then reports it broken)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime and stime (stat's fields 14, 15)


async def within_cpu_time(done: asyncio.Future[Any], pid: int, limit_s: float) -> Any:
    """``done``'s result, or :class:`TimeoutError` once process ``pid`` has spent ``limit_s`` of CPU
    on it, or :data:`WALL_BACKSTOP` times that in wall time (a process that gets no CPU at all).

    A limit on CPU time bounds the work a grammar is, which is what vLLM would spend on it, and
    holds on a loaded machine: a wall-clock limit refused an ordinary schema in CI while the
    replica's cores were busy with other requests."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WALL_BACKSTOP * limit_s
    started = cpu_seconds(pid) or 0.0
    while not done.done():
        await asyncio.wait([done], timeout=CPU_POLL_S)
        used = cpu_seconds(pid)
        if not done.done() and ((used is not None and used - started > limit_s) or loop.time() > deadline):
            done.cancel()
            raise TimeoutError
    return done.result()


@dataclass
class Waiting:
    """Jobs of one kind running or waiting their turn in the checker process, and how many may
    (one API key: half of them)."""

    what: str  # as a refusal names them
    limit: int
    count: int = 0
    by_key: Counter[str | None] = field(default_factory=Counter)

    def full_for(self, key: str | None) -> bool:
        return self.count >= self.limit or (key is not None and self.by_key[key] >= max(1, self.limit // 2))

    def add(self, key: str | None, change: int) -> None:
        self.count += change
        self.by_key[key] += change
        if not self.by_key[key]:
            del self.by_key[key]


class BodyChecker:
    """The model replica's checker process, restarted if it dies or is killed.

    ``check`` is :func:`check_body`, ``build`` is :func:`build_grammar` and ``warm`` imports what
    they need, unless a test swaps them.
    """

    def __init__(
        self,
        check: Callable[[type[BaseModel], bytes, ToJSON | None], CheckedBody | APIError] = check_body,
        warm: Callable[[], None] | None = _warm_up,
        build: Callable[[bytes], str | None] = build_grammar,
    ) -> None:
        self._check = check
        self._warm = warm
        self._build = build
        self._process: tuple[ProcessPoolExecutor, int] | None = None  # the pool and its one process's pid
        self._one_at_a_time = TakeTurns()  # turns round the API keys with jobs waiting
        self._turns: set[asyncio.Future[Any]] = set()  # jobs running or waiting their turn
        self._bodies = Waiting("large request bodies", MAX_WAITING)
        self._grammars = Waiting("grammars", MAX_WAITING_GRAMMARS)

    async def check(
        self, request_model: type[BaseModel], raw: bytes, to_json: ToJSON | None = None, key: str | None = None
    ) -> CheckedBody:
        """The checked body of a request of API key ``key`` (None: no keys), or the :class:`APIError`
        a client gets (400, 429, 500)."""
        result = await self._run(self._bodies, key, self._check, request_model, raw, to_json)
        if isinstance(result, APIError):
            raise result
        return result

    async def build_grammar(self, request: bytes, time_limit_s: float, param: str, key: str | None = None) -> None:
        """Build the grammar of ``request`` (pickled) within ``time_limit_s``, or refuse it: 400
        ``grammar_too_costly`` past the limit, 400 ``invalid_grammar`` if it cannot be built, each
        naming ``param`` (429 and 500 as :meth:`check`)."""
        try:
            error = await self._run(self._grammars, key, self._build, request, time_limit_s=time_limit_s)
        except TimeoutError:
            raise APIError(
                400,
                f"the grammar of this request's structured-output spec took more than {time_limit_s:g} s to "
                "build, this server's limit; ask for fewer items, repetitions or alternatives",
                param=param,
                code=GRAMMAR_TOO_COSTLY,
            ) from None
        if error is not None:
            raise APIError(
                400,
                f"the grammar of this request's structured-output spec cannot be built: {error[:300]}",
                param=param,
                code=INVALID_GRAMMAR,
            )

    async def _run(
        self,
        waiting: Waiting,
        key: str | None,
        job: Callable[..., Any],
        *args: Any,
        time_limit_s: float | None = None,
    ) -> Any:
        if waiting.full_for(key):
            whose = "this server is" if waiting.count >= waiting.limit else "this API key's requests are"
            raise APIError(
                429,
                f"{whose} already having {waiting.what} checked here; retry shortly",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        waiting.add(key, 1)
        # A job goes on, within its limit, when its client leaves: the next job's limit counts only its own.
        turn = asyncio.ensure_future(self._run_in_turn(waiting, key, job, args, time_limit_s))
        self._turns.add(turn)
        turn.add_done_callback(self._turn_ended)
        return await asyncio.shield(turn)

    async def _run_in_turn(
        self,
        waiting: Waiting,
        key: str | None,
        job: Callable[..., Any],
        args: tuple[Any, ...],
        time_limit_s: float | None,
    ) -> Any:
        try:
            async with self._one_at_a_time.turn(key):  # so a time limit counts only its own job
                pool, pid = self._process or await self._start()
                done = asyncio.wrap_future(pool.submit(job, *args))
                if time_limit_s is None:
                    return await done
                try:
                    return await within_cpu_time(done, pid, time_limit_s)
                except TimeoutError:
                    logger.warning(
                        "a job in the checker process ran past %s s of CPU; killing the process", time_limit_s
                    )
                    self._stop(kill=True)
                    raise
        except BrokenProcessPool:
            logger.error("the checker process died; starting another")
            self._stop()
            raise APIError(500, "the request could not be checked", code="internal_error") from None
        finally:
            waiting.add(key, -1)

    def _turn_ended(self, turn: asyncio.Future[Any]) -> None:
        self._turns.discard(turn)
        if not turn.cancelled():
            turn.exception()  # retrieved here too: its client may have left

    async def _start(self) -> tuple[ProcessPoolExecutor, int]:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=checker_context(), initializer=self._warm)
        try:
            # The process starts inside submit, through the forkserver, whose answer waits until it has
            # imported what it preloads (seconds, the first time on a replica): in a thread, or every
            # stream of this replica would stall meanwhile.
            started = await asyncio.to_thread(pool.submit, os.getpid)
            pid = await asyncio.wrap_future(started)  # once warm: a time limit does not count the start
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._process = pool, pid
        return self._process

    def _stop(self, kill: bool = False) -> None:
        if self._process is None:
            return
        pool, pid = self._process
        self._process = None
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._stop()
