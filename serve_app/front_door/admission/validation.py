"""Strict request validation with the OpenAI API's semantics, on top of vLLM's request models.

vLLM's models are lenient where OpenAI's API is not: pydantic's lax mode turns
``"stream": "yes"`` into true and ``"max_tokens": "5"`` into 5, a message with an
unknown role passes as a custom message, unknown parameters are ignored (vLLM's
removed guided-decoding fields among them, so output would silently not be
constrained), and ranges are checked late or not at all. Here a body is
checked as bytes (UTF-8, nesting: :mod:`serve_app.front_door.admission.json_body`), then
validated with vLLM's model in strict JSON mode (JSON types must match), then against the OpenAI API's documented
rules. Every failure is a 400 that names the parameter.

Runs in each model replica (and its checker process, for a large body).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError
from vllm.exceptions import VLLMClientError

from serve_app.errors import APIError, quoted
from serve_app.front_door.admission.responses_rules import check_served
from serve_app.glm4.control_tokens import MARK_REFUSED, find_control_mark
from serve_app.protocol import GenerationRequest, as_generation_request

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_STOP_SEQUENCES = 4

# The OpenAI API's documented bounds, inclusive; None: unbounded on that side.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "n": (1, 128),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
    "max_tokens": (1, None),
    "max_completion_tokens": (1, None),
    "max_output_tokens": (1, None),
    "top_logprobs": (0, 20),
}
COMPLETION_LOGPROBS = (0, 5)  # /v1/completions: logprobs is a count, at most 5

# OpenAI parameters vLLM does not know that change nothing in the answer: accepted and dropped,
# so clients that always send them (store=false, metadata for their own bookkeeping) work.
IGNORED_OPENAI_PARAMS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
STORED_RESPONSES_PARAMS = frozenset({"store"})  # the Responses API's `store` is served (front_door/answer_log)

# vLLM parameters this server refuses, with why: each would let a request skip what the server guarantees.
REFUSED_VLLM_PARAMS = {
    "kv_transfer_params": (
        "kv_transfer_params is for vLLM's disaggregated prefill, which this server does not run; "
        "its prompt_token_ids would skip the chat template"
    ),
    "ec_transfer_params": "ec_transfer_params is for vLLM's disaggregated encoders, which this server does not run",
} | {
    name: f"{name} is for multimodal models; GLM-4-9B-Chat takes text only"
    for name in ("mm_processor_kwargs", "media_io_kwargs", "mm_payload", "return_mm_kwargs")
}


def field_names(model: type[BaseModel]) -> frozenset[str]:
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias)
    return frozenset(names)


def parse_request(model: type[BaseModel], body: dict[str, Any]) -> GenerationRequest:
    """Validate ``body`` strictly with vLLM's ``model``; a fresh uuid4 replaces any client request id
    (a Responses API request's is its response's id, ``resp_`` and the uuid)."""
    responses = "input" in model.model_fields  # (the Responses API's request model)
    for name in (IGNORED_OPENAI_PARAMS - STORED_RESPONSES_PARAMS if responses else IGNORED_OPENAI_PARAMS) & body.keys():
        del body[name]
    for name in REFUSED_VLLM_PARAMS.keys() & body.keys():
        raise APIError(400, REFUSED_VLLM_PARAMS[name], param=name)
    unknown = sorted(set(body) - field_names(model))
    if unknown:  # OpenAI's answer too; vLLM would ignore them and answer as if they were not sent
        name = quoted(unknown[0])
        raise APIError(400, f"unrecognized request argument supplied: {name}", param=name)
    if "messages" in body:
        check_roles(body["messages"])
    if responses:
        check_served(body)
    check_no_control_mark_in_grammar(body)
    body["request_id"] = f"resp_{uuid.uuid4().hex}" if responses else uuid.uuid4().hex
    try:
        # JSON mode, strict: a JSON string is never a number or a boolean, a float never an int.
        payload = model.model_validate_json(json.dumps(body), strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except VLLMClientError as exc:  # raised by vLLM's own model validators, naming the parameter
        raise APIError(400, f"invalid request: {exc.args[0]}", param=getattr(exc, "parameter", None)) from None
    except ValueError as exc:
        raise APIError(400, f"invalid request: {exc}") from None
    except (TypeError, AttributeError, KeyError):  # a vLLM validator met a shape it did not expect
        raise APIError(400, "invalid request: a parameter has the wrong shape") from None
    check_ranges(body)  # what the client sent, now known to have the right JSON types
    return as_generation_request(payload)


GRAMMAR_PARAMS = ("response_format", "structured_outputs", "tools", "text")  # ("text": the Responses API's format)


def check_no_control_mark_in_grammar(body: dict[str, Any]) -> None:
    """What a grammar is built from may not hold GLM-4's control mark: llguidance is given the
    control tokens' texts behind it, so text the grammar forces never spells one
    (``serve_app/vllm_internals.py``, ``llguidance_tokenizer``)."""
    for name in GRAMMAR_PARAMS:
        where = find_control_mark(body.get(name), name)
        if where is not None:
            raise APIError(400, f"{quoted(where)} {MARK_REFUSED}", param=name)


def check_roles(messages: Any) -> None:
    if not isinstance(messages, list):
        raise APIError(400, "messages must be an array of messages", param="messages")
    if not messages:
        raise APIError(400, "messages is empty; send at least one message", param="messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in ROLES:
            raise APIError(
                400,
                f"messages[{i}].role is '{quoted(role)}'; expected one of: {', '.join(sorted(ROLES))}",
                param=f"messages.{i}.role",
            )


def check_ranges(body: dict[str, Any]) -> None:
    bounds = dict(RANGES)
    if type(body.get("logprobs")) is int:  # /v1/completions counts them; chat's is a boolean
        bounds["logprobs"] = COMPLETION_LOGPROBS
    for name, (low, high) in bounds.items():
        value = body.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            raise APIError(400, f"{name} is {value}; {_describe(low, high)}", param=name)
    stop = body.get("stop")
    if isinstance(stop, list):
        if len(stop) > MAX_STOP_SEQUENCES:
            raise APIError(400, f"stop has {len(stop)} sequences; at most {MAX_STOP_SEQUENCES}", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop sequences must not be empty", param="stop")
    logit_bias = body.get("logit_bias")
    for token, bias in logit_bias.items() if isinstance(logit_bias, dict) else ():
        if isinstance(bias, (int, float)) and not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias[{token}] is {bias}; it must be between -100 and 100", param="logit_bias")


def _describe(low: float | None, high: float | None) -> str:
    if high is None:
        return f"it must be at least {low:g}"
    return f"it must be between {low:g} and {high:g}"


def validation_error(exc: ValidationError) -> APIError:
    """A 400 that names the first offending parameter and says what is wrong with each.

    Pydantic's locations also name the union branch it tried (``stop.list[str]``,
    ``messages.0.ChatCompletionUserMessageParam.content.str``); clients know only
    the parameter path (``stop``, ``messages.0.content``), so branches are dropped
    and each parameter is reported once.
    """
    problems: dict[str, str] = {}
    for error in exc.errors(include_url=False, include_input=False):
        problems.setdefault(parameter_path(error["loc"]), error["msg"])
    details = "; ".join(f"{param}: {msg}" if param else msg for param, msg in problems.items())
    return APIError(400, f"invalid request: {details}", param=next((p for p in problems if p), None))


_PARAM_SEGMENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def parameter_path(loc: tuple[int | str, ...]) -> str:
    """``messages.0.content`` from a pydantic location, without union branch names."""
    named = [
        str(part) for part in loc if isinstance(part, int) or (_PARAM_SEGMENT.match(part) and part not in _TYPE_NAMES)
    ]
    return ".".join(named)
