"""The front door's HTTP app with a fake engine, for unit tests of the front door's own decisions.

The fakes stand in for Ray handles only; the real path (Ray Serve + vLLM) is
proven in tests/e2e.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from starlette.testclient import TestClient

from serve_app.config import CORSConfig
from serve_app.deployments.rate_limiter import RateLedger
from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.capacity import GenerationSlots
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.rate_limits import KeyLimits
from serve_app.front_door.admission.request_cost import CostLimits
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.http_api.app import build_http_app
from serve_app.front_door.telemetry.record import Phase, RequestRecord

CHAT = {"model": "glm-4-9b-chat", "messages": [{"role": "user", "content": "hi"}]}


HANG = object()  # an item that never arrives: the replica is busy or stuck
SLOW = object()  # the next item comes after 0.6 s: a long answer under way
TICK = object()  # the next item comes after 0.02 s: an answer being made

SHORT = TimeLimits(request_timeout_s=0.3, first_token_timeout_s=0.1)  # deadlines a unit test reaches


class FakeResponses:
    """Mimics a DeploymentResponseGenerator: async-iterable with cancel()."""

    def __init__(self, items: list[Any]):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item is SLOW or item is TICK:
            await asyncio.sleep(0.6 if item is SLOW else 0.02)
            item = self.items.pop(0)
        if item is HANG:
            await asyncio.Event().wait()  # only a deadline ends this wait
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class FakeModel:
    """Stands in for the engine (a :class:`~serve_app.front_door.core.generation.Model`): answers the
    n-th call with ``calls[n]`` (the last script repeats)."""

    def __init__(self, calls: list[list[Any]]):
        self.calls = calls
        self.payloads: list[Any] = []
        self.trace_contexts: list[dict[str, str] | None] = []
        self.last: FakeResponses | None = None
        self.on_call: Callable[[], None] | None = None  # run as each call is made (a test's probe)

    def generate(self, method: str, payload: Any, trace_context: dict[str, str] | None = None) -> FakeResponses:
        self.payloads.append(payload)
        self.trace_contexts.append(trace_context)
        if self.on_call is not None:
            self.on_call()
        self.last = FakeResponses(self.calls[min(len(self.payloads), len(self.calls)) - 1])
        return self.last


class FixedReadiness:
    """Stands in for ReadinessWatch: always the same answer."""

    def __init__(self, answer: Readiness) -> None:
        self.answer = answer

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def readiness(self) -> Readiness:
        return self.answer


def client_for(
    items: list[Any],
    limit: int = 1 << 20,
    healthy: bool = True,
    limits: TimeLimits | None = None,
    then: Sequence[list[Any]] = (),
    retry_s: float = 0.0,
    api_keys: APIKeys | None = None,
    cors: CORSConfig | None = None,
    key_limits: KeyLimits | None = None,
    metrics: Any = None,
    log_content: bool = False,
    max_output_tokens: int | None = None,
    body_timeout_s: float = 30.0,
    slots: GenerationSlots | None = None,
    costs: CostLimits | None = None,
    isolate_prefix_cache: bool = False,
    keepalive_s: float | None = None,
    stall_s: float | None = None,
) -> tuple[TestClient, FakeModel]:
    """A client of the front door's app; its model answers ``items``, and later calls ``then``."""
    handle = FakeModel([items, *then])
    router = ModelCatalog({"glm-4-9b-chat": ModelEntry("glm-4-9b-chat", handle, 1024, max_output_tokens)})

    readiness = FixedReadiness(Readiness({"glm-4-9b-chat": healthy}, age_s=0.5, max_age_s=30))

    settings = IngressSettings(
        max_request_body_bytes=limit,
        time_limits=limits or TimeLimits(600, 120),
        unavailable_retry_s=retry_s,
        body_timeout_s=body_timeout_s,
        cors=cors,
        log_content=log_content,
        costs=costs or CostLimits(),
        isolate_prefix_cache=isolate_prefix_cache,
        sse_keepalive_s=keepalive_s,
        stream_stall_timeout_s=stall_s,
    )
    core = FrontDoor(BodyRules(settings, router, key_limits), api_keys=api_keys, slots=slots, metrics=metrics)
    app = build_http_app(core, readiness)
    return TestClient(app, raise_server_exceptions=False), handle


class RecordingMetrics:
    """Stands in for ServingMetrics: keeps what it is told."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.moves: list[tuple[str | None, Phase, Phase]] = []

    def ended(self, record: RequestRecord) -> None:
        self.records.append(record)

    def moved(self, record: RequestRecord, old: Phase, new: Phase) -> None:
        self.moves.append((record.model, old, new))


KEYS = "sk-alpha-0123456789ab\nsk-beta-0123456789abc"  # two API keys, one per line


class LedgerHandle:
    """Stands in for the RateLimiter deployment's handle: calls a ledger in process."""

    def __init__(self, ledger: RateLedger | None = None, fail: BaseException | None = None):
        self.ledger, self.fail, self.now = ledger, fail, 0.0
        self.charged: list[tuple[str, int]] = []
        self.sessions: list[tuple[str, str, str]] = []  # (session id, method, key id) of each call
        self.session_id = ""
        handle = self

        class Call:
            def __init__(self, name: str):
                self.name = name

            def remote(self, *args: Any) -> Any:
                handle.sessions.append((handle.session_id, self.name, args[0]))
                return handle.call(self.name, *args)

        self.admit, self.charge, self.release = Call("admit"), Call("charge"), Call("release")
        self.renew = Call("renew")

    def options(self, *, session_id: str) -> LedgerHandle:
        self.session_id = session_id  # (the calls that follow are sent at once, as a handle's)
        return self

    def call(self, name: str, *args: Any) -> Any:
        handle = self

        class Response:
            def __await__(self):
                return self.run().__await__()

            async def run(self):
                if handle.fail is not None:
                    raise handle.fail
                if name == "charge":
                    handle.charged.append(args)
                if name == "release":  # (the only call that needs no time)
                    return handle.ledger.release(*args)
                return getattr(handle.ledger, name)(*args, now=handle.now)

            def cancel(self):
                pass

        return Response()


class FakeContext:
    """Stands in for Serve's RayServegRPCContext: metadata in; code, details and trailing metadata out."""

    def __init__(self, metadata: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        self.metadata = list(metadata)
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = [("request_id", "abc")]  # what Serve's proxy put there

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return self.trailing

    def set_trailing_metadata(self, metadata: list[tuple[str, str]]) -> None:
        self.trailing = list(metadata)
