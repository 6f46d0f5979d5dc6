"""What every generation request passes between its body and the engine, whichever door brought it.

The HTTP routes (:mod:`serve_app.front_door.http_api.app`) and the gRPC service
(:mod:`serve_app.front_door.grpc_api.service`) receive requests differently and answer
differently. Both hand :func:`admit` the request's body
(:mod:`serve_app.front_door.admission.request_body`: HTTP's bytes, or the gRPC message itself), and it
does the rest the same way for both: the size limit (413), the key's rate limits (429),
parsing and the structure checks (400; bodies over 256 KiB in the checker
process, :mod:`serve_app.front_door.admission.large_bodies`), routing by ``model`` (404),
validation with vLLM's request model (:mod:`serve_app.front_door.admission.validation`, 400),
what the request may cost (:mod:`serve_app.front_door.admission.request_cost`, 400), its
grammar built first within a time limit (:mod:`serve_app.front_door.admission.grammar_build`, 400), a
replica place per engine sequence with its key's rank
(:mod:`serve_app.front_door.admission.capacity`, 429) and the key's own prefix cache
(:mod:`serve_app.front_door.admission.cache_salt`).
The API key and the request's first place are taken by each door as the request
arrives, before its body is read, from the same objects (``settings.api_keys``,
``settings.generation_slots``).

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.errors import APIError
from serve_app.front_door.admission.cache_salt import key_cache_salt
from serve_app.front_door.admission.capacity import SlotHold
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.admission.grammar_build import pickled
from serve_app.front_door.admission.json_body import decode_body
from serve_app.front_door.admission.large_bodies import LARGE_BODY_BYTES
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.rate_limits import KeyLimits
from serve_app.front_door.admission.request_body import JSONBody, RequestBody
from serve_app.front_door.admission.request_cost import BodySize, check_costs, engine_sequences, measure
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.admission.validation import parse_request
from serve_app.front_door.core.generation import TokenCounter
from serve_app.front_door.telemetry.record import GRAMMAR_BUILT, RequestRecord
from serve_app.protocol import GenerationRequest, with_cache_salt, with_priority


def validated(
    models: ModelCatalog[Any], settings: IngressSettings, endpoint: Endpoint, body: dict[str, Any]
) -> tuple[ModelEntry[Any], GenerationRequest, BodySize]:
    """The model entry, the validated request and the measured costs of a decoded ``body``: 404 before any 400."""
    entry = models.entry_for(body.get("model"))
    payload = parse_request(endpoint.request_model, body)
    size = measure(body)
    check_limits(body, entry, settings, size)
    return entry, payload, size


def hold_sequences(
    hold: SlotHold | None, body: dict[str, Any], size: BodySize, payload: GenerationRequest, record: RequestRecord
) -> GenerationRequest:
    """Hold a place of the replica for each engine sequence the request starts
    (429 if they are not free) and give the request its key's rank as its engine priority."""
    if hold is None:
        return payload
    hold.grow_to(engine_sequences(body, size.prompt.prompts), record)
    return with_priority(payload, hold.rank)


def check_limits(body: dict[str, Any], entry: ModelEntry[Any], settings: IngressSettings, size: BodySize) -> None:
    """The server's own limits on what one request costs the engine
    (:mod:`serve_app.front_door.admission.request_cost`)."""
    check_costs(body, size, settings.costs, entry.max_model_len, entry.max_output_tokens)


async def build_grammar_first(
    settings: IngressSettings, payload: GenerationRequest, size: BodySize, record: RequestRecord
) -> None:
    """Build the request's grammar in the checker process, within ``ingress.max_grammar_build_s``
    (400 ``grammar_too_costly`` past it; :mod:`serve_app.front_door.admission.grammar_build`), in its key's turn;
    its outcome is left in ``record`` (counted by :mod:`serve_app.front_door.telemetry.metrics`)."""
    if size.grammar_chars and settings.costs.max_grammar_build_s is not None:
        try:
            await settings.body_checker.build_grammar(
                pickled(payload), settings.costs.max_grammar_build_s, size.grammar_param, record.key_id
            )
        except APIError as refused:
            if refused.status == 400:  # (a 429 or 500 from the checker: no build was made)
                record.grammar_build = refused.code
            raise
        record.grammar_build = GRAMMAR_BUILT


async def admit_key(limits: KeyLimits | None, record: RequestRecord) -> TokenCounter | None:
    """Ask the limits of the request's key (429 when spent), leaving in ``record`` the place it takes among
    its key's requests at once (given back as the record ends); the counter to tell its tokens to, when
    they are counted."""
    if limits is None or record.key_id is None:
        return None
    record.key_lease = await limits.admit(record.key_id)
    return functools.partial(limits.charge, record.key_id) if limits.counts_tokens else None


# Turns a decoded body into the one admitted, before it is validated (a Responses request's
# previous_response_id into its conversation: serve_app.front_door.answer_log.history).
Expand = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
EXPANDED_FIELD = b'"previous_response_id"'  # only a body naming it is expanded


async def expanded_large_body(body: RequestBody, expand: Expand) -> RequestBody:
    """A large body, expanded: decoded and encoded again off the event loop, as the checker needs bytes."""
    if EXPANDED_FIELD not in body.json():
        return body
    fields = await asyncio.to_thread(lambda: decode_body(body.json()))
    expanded = await expand(fields)
    return body if expanded is fields else JSONBody(await asyncio.to_thread(lambda: json.dumps(expanded).encode()))


@dataclass(frozen=True)
class Admitted:
    """A request let through: the model that answers it, the request to send, and whom to tell its tokens."""

    entry: ModelEntry[Any]
    payload: GenerationRequest
    on_tokens: TokenCounter | None


async def admit(
    body: RequestBody,
    endpoint: Endpoint,
    models: ModelCatalog[Any],
    settings: IngressSettings,
    record: RequestRecord,
    hold: SlotHold | None = None,
    expand: Expand | None = None,
) -> Admitted:
    """Every rule between a request's body and the engine (the module's docstring), raising the
    :class:`APIError` the client gets. ``expand``: what the decoded body becomes first, once its key
    is admitted."""
    if body.size > settings.max_request_body_bytes:
        raise APIError(413, f"the request is {body.size} bytes; the limit is {settings.max_request_body_bytes} bytes")
    # A key's limits before any work its body costs (parsing, the checker, a grammar's build): a key
    # at its limit gets its 429 for the price of the limiter's answer. (Its place is given back as
    # the record ends, whatever the request's end.)
    on_tokens = await admit_key(settings.key_limits, record)
    payload: GenerationRequest
    large = body.size > LARGE_BODY_BYTES
    if large and expand is not None:
        body = await expanded_large_body(body, expand)
    if large:  # checked in another process: it would stall every stream here
        checked = await settings.body_checker.check(endpoint.request_model, *body.for_checker(), record.key_id)
        fields, payload, size = checked.fields, checked.request, checked.size
        entry = models.entry_for(fields.get("model"))
        check_limits(fields, entry, settings, size)
    else:
        fields = decode_body(body.json())
        if expand is not None:
            fields = await expand(fields)
        entry, payload, size = validated(models, settings, endpoint, fields)
    record.model = entry.name
    await build_grammar_first(settings, payload, size, record)
    payload = hold_sequences(hold, fields, size, payload, record)
    if settings.isolate_prefix_cache and record.key_id is not None:
        payload = with_cache_salt(payload, key_cache_salt(record.key_id, fields.get("cache_salt")))
    record.request_id, record.stream = payload.request_id, bool(payload.stream)
    if record.keep_content:
        record.request_body = fields if not large else await asyncio.to_thread(lambda: decode_body(body.json()))
    return Admitted(entry, payload, on_tokens)
