"""``previous_response_id``: a stored response's conversation as the next request's input items.

The front door turns the id into items before the request is validated, measured and sent: the
items the stored response's answer followed, then its output (its messages as assistant
messages, its function calls as they were made), then the request's own input. So the
engine renders the whole conversation with vLLM's own Responses code, the cost bounds and the
context limit hold the whole of it, and a function call's output sent after a stored call
finds the call. The stored response's ``instructions`` do not carry over (OpenAI's rule).

Runs in each model replica.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, TypeAdapter

from serve_app.errors import APIError
from serve_app.front_door.answer_log.store import ResponseStore

PARAM = "previous_response_id"


def as_items(value: Any) -> list[Any]:
    """A Responses request's ``input`` (text, or items as sent) as a list of items."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


@functools.cache
def _input_adapter(request_model: type[BaseModel]) -> TypeAdapter[Any]:
    return TypeAdapter(request_model.model_fields["input"].annotation)  # (built once: it costs milliseconds)


def request_input_items(payload: Any) -> list[Any]:
    """A validated ``ResponsesRequest``'s input as JSON items, as the next turn's history keeps them."""
    request_model: type[BaseModel] = type(payload)
    return as_items(_input_adapter(request_model).dump_python(payload.input, mode="json"))


def output_as_input(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output items as input items: its text as assistant messages, its function calls."""
    items: list[dict[str, Any]] = []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            texts = [part.get("text", "") for part in item.get("content") or [] if part.get("type") == "output_text"]
            items.append({"type": "message", "role": "assistant", "content": "".join(texts)})
        elif item.get("type") == "function_call":
            items.append({key: item[key] for key in ("type", "call_id", "name", "arguments") if key in item})
    return items


def previous_not_found(previous_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {previous_id!r}", param=PARAM, code="response_not_found")


async def with_history(fields: dict[str, Any], store: ResponseStore, owner: str) -> dict[str, Any]:
    """``fields`` with its previous response's conversation before its input (404 when that
    response is not the caller's to read, 400 while it is still being answered)."""
    previous_id = fields.get(PARAM)
    if previous_id is None:
        return fields
    if not isinstance(previous_id, str):
        raise APIError(400, f"{PARAM} must be a string", param=PARAM)
    stored = await store.load(previous_id, owner)
    if stored is None or not stored.is_response:
        raise previous_not_found(previous_id)
    if not stored.finished:
        raise APIError(400, f"response {previous_id!r} is still {stored.status}", param=PARAM)
    history = await store.input_items(previous_id)
    return fields | {"input": history + output_as_input(stored.response) + as_items(fields.get("input"))}
