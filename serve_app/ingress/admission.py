"""What every generation request passes between parsing and a model replica, whichever protocol brought it.

The HTTP routes (:mod:`serve_app.ingress.routes`) and the gRPC service
(:mod:`serve_app.grpc_api.service`) read their requests differently and answer
differently; in between they do the same: route by ``model`` (404), validate
with vLLM's request model (:mod:`serve_app.ingress.validation`, 400), check the
server's limits (400), and ask the key's rate limits (429). One definition here
keeps the two front doors holding requests to the same rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from serve_app.ingress.capacity import SlotHold
from serve_app.ingress.rate_limits import KeyLimits
from serve_app.ingress.replica_client import TokenCounter
from serve_app.ingress.request_cost import BodySize, check_costs, engine_sequences, measure
from serve_app.ingress.router import ModelEntry, ModelRouter
from serve_app.ingress.settings import IngressSettings
from serve_app.ingress.validation import parse_request
from serve_app.observability.record import RequestRecord
from serve_app.protocol import GenerationRequest, with_priority


@dataclass(frozen=True)
class Endpoint:
    """A generation endpoint: its HTTP path, its vLLM request model and the replica method that answers it."""

    path: str
    request_model: type[BaseModel]
    method: str


def default_endpoints() -> list[Endpoint]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return [
        Endpoint("/v1/chat/completions", ChatCompletionRequest, "chat"),
        Endpoint("/v1/completions", CompletionRequest, "completion"),
    ]


def validated(
    router: ModelRouter[Any], settings: IngressSettings, endpoint: Endpoint, body: dict[str, Any]
) -> tuple[ModelEntry[Any], GenerationRequest, BodySize]:
    """The model entry, the validated request and the measured costs of a decoded ``body``: 404 before any 400."""
    entry = router.route(body.get("model"))
    payload = parse_request(endpoint.request_model, body)
    size = measure(body)
    check_limits(body, entry, settings, size)
    return entry, payload, size


def hold_sequences(
    hold: SlotHold | None, body: dict[str, Any], size: BodySize, payload: GenerationRequest, record: RequestRecord
) -> GenerationRequest:
    """With direct streaming, hold a place of the replica for each engine sequence the request starts
    (429 if they are not free) and give the request its key's rank as its engine priority."""
    if hold is None:
        return payload
    hold.grow_to(engine_sequences(body, size.prompt.prompts), record)
    return with_priority(payload, hold.rank)


def check_limits(body: dict[str, Any], entry: ModelEntry[Any], settings: IngressSettings, size: BodySize) -> None:
    """The server's own limits on what one request costs the engine (:mod:`serve_app.ingress.request_cost`)."""
    check_costs(body, size, settings.costs, entry.max_model_len, entry.max_output_tokens)


async def admit_key(limits: KeyLimits | None, record: RequestRecord) -> TokenCounter | None:
    """Ask the limits of the request's key (429 when spent), leaving in ``record`` the place it takes among
    its key's requests at once (given back as the record ends); the counter to tell its tokens to, when
    they are counted."""
    if limits is None or record.key_id is None:
        return None
    record.key_lease = await limits.admit(record.key_id)
    return functools.partial(limits.charge, record.key_id) if limits.counts_tokens else None
