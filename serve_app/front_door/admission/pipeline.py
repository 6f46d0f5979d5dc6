"""What every generation request passes between its body and the engine, whichever door brought it.

Each door hands :func:`admit` the request's body (:mod:`serve_app.front_door.admission.request_body`:
HTTP's bytes, or the gRPC message itself) with what the request holds so far (its permit,
:class:`Holdings`), and the rest is the same for both: the size limit (413), the key's rate limits
(429; its place among the key's requests at once goes into the permit at once), parsing and the
structure checks (400; bodies over 256 KiB in the checker process,
:mod:`serve_app.front_door.admission.large_bodies`), routing by ``model`` (404), validation with
vLLM's request model (:mod:`serve_app.front_door.admission.validation`, 400), what the request may
cost (:mod:`serve_app.front_door.admission.request_cost`, 400), its grammar built first within a
time limit (:mod:`serve_app.front_door.admission.grammar_build`, 400), a replica place per engine
sequence (:mod:`serve_app.front_door.admission.capacity`, 429) and the key's own prefix cache
(:mod:`serve_app.front_door.admission.cache_salt`).

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app.errors import APIError
from serve_app.front_door.admission.cache_salt import key_cache_salt
from serve_app.front_door.admission.capacity import SlotHold
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.admission.grammar_build import pickled
from serve_app.front_door.admission.json_body import decode_body
from serve_app.front_door.admission.large_bodies import LARGE_BODY_BYTES, BodyChecker, StoredParts
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.rate_limits import AtKeyCap, KeyLease, KeyLimits
from serve_app.front_door.admission.request_body import JSONBody, RequestBody
from serve_app.front_door.admission.request_cost import BodySize, check_costs, engine_sequences, measure
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.admission.validation import parse_request
from serve_app.front_door.telemetry.record import GRAMMAR_BUILT, RequestRecord
from serve_app.protocol import GenerationRequest, with_cache_salt, with_priority


class Holdings(Protocol):
    """What a request holds as it is admitted (its :class:`~serve_app.front_door.core.permit.Permit`):
    admission adds the key's lease and more places to it, and whoever closes it gives them back."""

    key_id: str | None
    places: SlotHold | None
    lease: KeyLease | None


@dataclass(frozen=True)
class BodyRules:
    """The rules every body passes, with the services they ask: built once per replica."""

    settings: IngressSettings
    models: ModelCatalog[Any]
    key_limits: KeyLimits | None = None  # None: no per-key limits
    body_checker: BodyChecker = field(default_factory=BodyChecker)


@dataclass(frozen=True)
class Admitted:
    """A request let through: the model that answers it, the request to send, the engine sequences
    it starts, whether it waits for its key's place (a background answer past its key's cap), and,
    for a Responses request, what its stored answer reads of it."""

    entry: ModelEntry[Any]
    payload: GenerationRequest
    sequences: int = 1
    waits_for_key: AtKeyCap | None = None
    stored: StoredParts | None = None

    @property
    def background(self) -> bool:
        return self.stored is not None and bool(self.stored.request.background)

    @property
    def to_store(self) -> bool:
        """Stored once answered (the Responses API's ``store``, its default)."""
        return self.stored is not None and bool(self.stored.request.store)


def validated(
    rules: BodyRules, endpoint: Endpoint, body: dict[str, Any]
) -> tuple[ModelEntry[Any], GenerationRequest, BodySize]:
    """The model entry, the validated request and the measured costs of a decoded ``body``: 404 before any 400."""
    entry = rules.models.entry_for(body.get("model"))
    payload = parse_request(endpoint.request_model, body)
    size = measure(body)
    check_limits(body, entry, rules.settings, size)
    return entry, payload, size


def check_limits(body: dict[str, Any], entry: ModelEntry[Any], settings: IngressSettings, size: BodySize) -> None:
    """The server's own limits on what one request costs the engine
    (:mod:`serve_app.front_door.admission.request_cost`)."""
    check_costs(body, size, settings.costs, entry.max_model_len, entry.max_output_tokens)


async def build_grammar_first(
    rules: BodyRules, payload: GenerationRequest, size: BodySize, record: RequestRecord
) -> None:
    """Build the request's grammar in the checker process, within ``ingress.max_grammar_build_s``
    (400 ``grammar_too_costly`` past it; :mod:`serve_app.front_door.admission.grammar_build`), in its
    key's turn; its outcome is left in ``record`` (counted by :mod:`serve_app.front_door.telemetry.metrics`)."""
    limit_s = rules.settings.costs.max_grammar_build_s
    if size.grammar_chars and limit_s is not None:
        try:
            await rules.body_checker.build_grammar(pickled(payload), limit_s, size.grammar_param, record.key_id)
        except APIError as refused:
            if refused.status == 400:  # (a 429 or 500 from the checker: no build was made)
                record.grammar_build = refused.code
            raise
        record.grammar_build = GRAMMAR_BUILT


# Turns a decoded body into the one admitted, before it is validated (a Responses request's
# previous_response_id into its conversation: serve_app.front_door.answer_log.history).
Expand = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
EXPANDED_FIELD = b'"previous_response_id"'  # only a body naming it is expanded
BACKGROUND_FIELD = b'"background"'  # only a body naming it may wait for its key's place
# A Responses body of more JSON objects than this is checked in the checker process, whatever its
# size: vLLM's model validates each input item, content part and tool in pure Python at tens of
# microseconds each (docs/performance-history.md), so 8,000 small items in 240 KB held the event loop
# half a second. Below it, a body's validation holds the loop a few milliseconds at most.
RESPONSES_OBJECTS_IN_LINE = 128


def checked_apart(body: RequestBody, endpoint: Endpoint) -> bool:
    """Whether a body is checked in the checker process: past 256 KiB, or a Responses body of many
    objects (counted in its bytes, in one pass)."""
    if body.size > LARGE_BODY_BYTES:
        return True
    return endpoint.method == "responses" and body.json().count(b"{") > RESPONSES_OBJECTS_IN_LINE


def objects_in(fields: dict[str, Any]) -> int:
    """About how many JSON objects an expanded Responses body holds: its input's items and their
    content parts, and its tools (what validation walks one by one)."""
    items = fields.get("input")
    count = len(fields.get("tools") or []) + 1
    for item in items if isinstance(items, list) else ():
        content = item.get("content") if isinstance(item, dict) else None
        count += 1 + (len(content) if isinstance(content, list) else 0)
    return count


async def expanded_large_body(body: RequestBody, expand: Expand) -> RequestBody:
    """A large body, expanded: decoded and encoded again off the event loop, as the checker needs bytes."""
    if EXPANDED_FIELD not in body.json():
        return body
    fields = await asyncio.to_thread(lambda: decode_body(body.json()))
    expanded = await expand(fields)
    return body if expanded is fields else JSONBody(await asyncio.to_thread(lambda: json.dumps(expanded).encode()))


async def admit_key(rules: BodyRules, holdings: Holdings, endpoint: Endpoint, body: RequestBody) -> AtKeyCap | None:
    """Ask the limits of the request's key (429 when spent), its lease put in ``holdings`` at once.
    A Responses body that names ``background`` and finds its key at its cap is let on (the refusal
    returned): a background answer waits for its key's place rather than being refused."""
    limits = rules.key_limits
    if limits is None or holdings.key_id is None:
        return None
    try:
        holdings.lease = await limits.admit(holdings.key_id)
    except AtKeyCap as at_cap:
        if endpoint.method != "responses" or BACKGROUND_FIELD not in body.json():
            raise
        return at_cap
    return None


async def admit(
    rules: BodyRules,
    body: RequestBody,
    endpoint: Endpoint,
    record: RequestRecord,
    holdings: Holdings,
    expand: Expand | None = None,
) -> Admitted:
    """Every rule between a request's body and the engine (the module's docstring), raising the
    :class:`APIError` the client gets. ``expand``: what the decoded body becomes first, once its key
    is admitted."""
    settings = rules.settings
    if body.size > settings.max_request_body_bytes:
        raise APIError(413, f"the request is {body.size} bytes; the limit is {settings.max_request_body_bytes} bytes")
    # A key's limits before any work its body costs (parsing, the checker, a grammar's build): a key
    # at its limit gets its 429 for the price of the limiter's answer.
    at_cap = await admit_key(rules, holdings, endpoint, body)
    payload: GenerationRequest
    stored: StoredParts | None = None
    large = checked_apart(body, endpoint)
    if large and expand is not None:
        body = await expanded_large_body(body, expand)
    fields: dict[str, Any] = {}
    if not large:
        fields = decode_body(body.json())
        if expand is not None and (expanded := await expand(fields)) is not fields:
            fields = expanded
            if objects_in(fields) > RESPONSES_OBJECTS_IN_LINE:  # a long history: checked apart, as a long body
                body, large = JSONBody(await asyncio.to_thread(lambda: json.dumps(expanded).encode())), True
    if large:  # checked in another process: it would stall every stream here
        checked = await rules.body_checker.check(endpoint.request_model, *body.for_checker(), record.key_id)
        fields, payload, size = checked.fields, checked.request, checked.size
        entry = rules.models.entry_for(fields.get("model"))
        check_limits(fields, entry, settings, size)
        stored = pickle.loads(checked.stored) if checked.stored is not None else None  # (small: no input)
    else:
        entry, payload, size = validated(rules, endpoint, fields)
        stored = StoredParts(payload) if endpoint.method == "responses" else None
    if at_cap is not None and not (stored is not None and stored.request.background):
        raise at_cap  # (named "background" without asking for it)
    record.model = entry.name
    await build_grammar_first(rules, payload, size, record)
    sequences = engine_sequences(fields, size.prompt.prompts)
    if holdings.places is not None and at_cap is None:
        holdings.places.grow_to(sequences, record)  # 429 if they are not free
        payload = with_priority(payload, holdings.places.rank)
    if settings.isolate_prefix_cache and record.key_id is not None:
        payload = with_cache_salt(payload, key_cache_salt(record.key_id, fields.get("cache_salt")))
    record.request_id, record.stream = payload.request_id, bool(payload.stream)
    if record.log_content:
        record.request_body = fields if not large else await asyncio.to_thread(lambda: decode_body(body.json()))
    return Admitted(entry, payload, sequences, at_cap, stored)
