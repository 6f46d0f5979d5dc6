"""A front door's core as the unit tests build it: the real admission, HTTP app and store, over a
model whose answers each test holds and releases."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from serve_app.deployments.rate_limiter import RateLedger
from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.capacity import GenerationSlots
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.rate_limits import KeyLimits
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.store import ResponseStore
from serve_app.front_door.core.background import BackgroundAnswers
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.http_api.app import build_http_app
from tests.unit.front_door.fakes import KEYS, FixedReadiness, LedgerHandle

MODEL = "glm-4-9b-chat"
ALPHA, BETA = "sk-alpha-0123456789ab", "sk-beta-0123456789abc"


class Answer:
    """One engine answer the test holds: its first chunk at once, the rest once released."""

    def __init__(self, method: str, request_id: str) -> None:
        self.method, self.request_id = method, request_id
        self.release = asyncio.Event()
        self.cancelled = False
        self.sent = False

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> Any:
        if not self.sent:
            self.sent = True
            return self._event("response.created", "in_progress") if self.method == "responses" else CHUNK
        if self.release.is_set() and self.method:
            self.method = ""  # (its last event given: its outcome next)
            return self._event("response.completed", "completed") if self.sent else CHUNK
        if self.release.is_set():
            raise StopAsyncIteration
        await self.release.wait()
        return await self.__anext__()

    def _event(self, kind: str, status: str) -> str:
        response = {"id": self.request_id, "object": "response", "status": status}
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'response': response})}\n\n"

    def cancel(self) -> None:
        self.cancelled = True


CHUNK = 'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'


class HeldModel:
    """The engine: every answer held until the test releases it."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []

    def generate(self, method: str, payload: Any, trace_context: Any = None) -> Answer:
        answer = Answer(method, payload.request_id)
        self.answers.append(answer)
        return answer

    def running(self) -> list[Answer]:
        return [a for a in self.answers if not a.release.is_set() and not a.cancelled]


def core_with(
    limit: int = 16,
    max_concurrent: int | None = None,
    max_waiting: int = 4,
    background_limit: int = 64,
    store: ResponseStore | None = None,
) -> tuple[FrontDoor, HeldModel, LedgerHandle]:
    """A front door over a held model (its answers end when a test says) and ``store`` (the in-process one)."""
    model = HeldModel()
    settings = IngressSettings(max_request_body_bytes=1 << 20, time_limits=TimeLimits(600, 120), log_requests=False)
    limiter = LedgerHandle(RateLedger(None, None, max_concurrent))
    limits = KeyLimits(limiter, counts_tokens=False, max_concurrent=max_concurrent)
    store = store or MemoryStore(60, 100)
    stored = StoredResponses(store, store, BackgroundAnswers(store, background_limit, 60.0, max_waiting), 60.0)
    rules = BodyRules(settings, ModelCatalog({MODEL: ModelEntry(MODEL, model, 1024)}), limits)
    core = FrontDoor(rules, APIKeys("test keys", lambda: KEYS), GenerationSlots(limit, MODEL), stored=stored)
    return core, model, limiter


def client(core: FrontDoor) -> httpx.AsyncClient:
    app = build_http_app(core, FixedReadiness(Readiness({MODEL: True}, age_s=0.1, max_age_s=30)))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica", timeout=30)


def key(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def leases(limiter: LedgerHandle) -> int:
    assert limiter.ledger is not None
    return sum(len(held) for held in limiter.ledger.leases.values())


BACKGROUND = {"model": MODEL, "input": "hi", "background": True, "max_output_tokens": 8}
