"""Malformed and hostile requests, each with the 4xx it must get and the parameter it must name.

Shared by the front door's unit tests (fake replicas) and the end-to-end tests (the
real app), so both hold the same promise: every one of these is answered with an
OpenAI-shaped error, and none reaches an engine or hurts the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MODEL = "glm-4-9b-chat"
CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
BODY_LIMIT = 8388608  # ingress.max_request_body_bytes in deploy/config.cpu.yaml


@dataclass(frozen=True)
class Hostile:
    id: str
    body: bytes
    status: int
    param: str | None = None
    path: str = CHAT_PATH
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


MARKED = {"type": "object", "properties": {"v": {"const": "\ufdd0<|user|>"}}}  # the control mark, then a token's text


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | fields


def responses(**fields: Any) -> dict[str, Any]:
    """A Responses API body."""
    return {"model": MODEL, "input": "hi", "max_output_tokens": 4} | fields


def encoded(body: Any) -> bytes:
    return json.dumps(body).encode()


def nested(depth: int) -> bytes:
    return (
        b'{"model": "glm-4-9b-chat", "messages": [{"role": "user", "content": "hi"}], "metadata": '
        + (b"[" * depth + b"]" * depth)
        + b"}"
    )


def padded(body: dict[str, Any], size: int = 300_000) -> bytes:
    """``body`` grown to ``size`` bytes with JSON whitespace: large, so the front door checks it in another process."""
    raw = encoded(body)
    return raw[:-1] + b" " * max(0, size - len(raw)) + b"}"


def json_schema_format(properties: int) -> dict[str, Any]:
    """A response_format whose schema names ``properties`` string properties (about 20 characters each)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


BILLION = 1_000_000_000


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(items: dict[str, Any]) -> dict[str, Any]:
    """A function tool taking one argument, ``items``."""
    parameters = {"type": "object", "properties": {"items": items}, "required": ["items"]}
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


HOSTILE: list[Hostile] = [
    # The body itself
    Hostile("empty body", b"", 400),
    Hostile("not JSON", b"{model: glm}", 400),
    Hostile("truncated JSON", encoded(chat())[:-3], 400),
    Hostile("JSON array", b"[1, 2]", 400),
    Hostile("JSON string", b'"hello"', 400),
    Hostile("invalid UTF-8", b'{"model": "glm-4-9b-chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    Hostile("UTF-16", json.dumps(chat()).encode("utf-16"), 400),
    Hostile("NaN", encoded(chat())[:-1] + b', "temperature": NaN}', 400),
    Hostile("Infinity", encoded(chat())[:-1] + b', "top_p": Infinity}', 400),
    Hostile("nested 100000 deep", nested(100_000), 400),
    Hostile("150000 empty arrays", encoded(chat(metadata=[[]] * 150_000)), 400),
    Hostile("integer of 5000 digits", encoded(chat())[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", 400),
    Hostile("1e999 (infinity)", encoded(chat())[:-1] + b', "temperature": 1e999}', 400),
    Hostile("-1e999 (minus infinity)", encoded(chat())[:-1] + b', "top_p": -1e999}', 400),
    Hostile("nested 65 deep", nested(65), 400),
    Hostile("over the body limit", encoded(chat(messages=[{"role": "user", "content": "x" * BODY_LIMIT}])), 413),
    # Types are not coerced
    Hostile("stream 'yes'", encoded(chat(stream="yes")), 400, "stream"),
    Hostile("stream 1", encoded(chat(stream=1)), 400, "stream"),
    Hostile("max_tokens '5'", encoded(chat(max_tokens="5")), 400, "max_tokens"),
    Hostile("max_tokens 5.5", encoded(chat(max_tokens=5.5)), 400, "max_tokens"),
    Hostile("temperature '0.5'", encoded(chat(temperature="0.5")), 400, "temperature"),
    Hostile("n true", encoded(chat(n=True)), 400, "n"),
    Hostile("seed '1'", encoded(chat(seed="1")), 400, "seed"),
    Hostile("stop 42", encoded(chat(stop=42)), 400, "stop"),
    Hostile("model 42", encoded(chat(model=42)), 400, "model"),
    Hostile("messages an object", encoded(chat(messages={"role": "user", "content": "hi"})), 400, "messages"),
    Hostile("content a number", encoded(chat(messages=[{"role": "user", "content": 7}])), 400, "messages.0.content"),
    Hostile("tools an object", encoded(chat(tools={"type": "function"})), 400, "tools"),
    # What grammars are built from may not hold GLM-4's control mark (serve_app/vllm_internals.py).
    Hostile(
        "control mark in a response_format schema",
        encoded(chat(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": MARKED}})),
        400,
        "response_format",
    ),
    Hostile(
        "control mark in a structured_outputs regex",
        encoded(chat(structured_outputs={"regex": "\ufdd0<\\|user\\|>"})),
        400,
        "structured_outputs",
    ),
    Hostile(
        "control mark in a tool's schema",
        encoded(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": MARKED}}])),
        400,
        "tools",
    ),
    # Ranges
    Hostile("max_tokens 0", encoded(chat(max_tokens=0)), 400, "max_tokens"),
    Hostile("max_tokens -1", encoded(chat(max_tokens=-1)), 400, "max_tokens"),
    Hostile("max_completion_tokens 0", encoded(chat(max_completion_tokens=0)), 400, "max_completion_tokens"),
    Hostile("max_tokens 10**30", encoded(chat(max_tokens=10**30)), 400, "max_tokens"),
    Hostile("temperature 2.5", encoded(chat(temperature=2.5)), 400, "temperature"),
    Hostile("temperature -0.1", encoded(chat(temperature=-0.1)), 400, "temperature"),
    Hostile("top_p 1.5", encoded(chat(top_p=1.5)), 400, "top_p"),
    Hostile("n 0", encoded(chat(n=0)), 400, "n"),
    Hostile("n 129", encoded(chat(n=129)), 400, "n"),
    Hostile("presence_penalty 3", encoded(chat(presence_penalty=3)), 400, "presence_penalty"),
    Hostile("frequency_penalty -3", encoded(chat(frequency_penalty=-3)), 400, "frequency_penalty"),
    Hostile("top_logprobs 21", encoded(chat(logprobs=True, top_logprobs=21)), 400, "top_logprobs"),
    Hostile("five stop sequences", encoded(chat(stop=["a", "b", "c", "d", "e"])), 400, "stop"),
    Hostile("empty stop sequence", encoded(chat(stop=[""])), 400, "stop"),
    Hostile("logit_bias 500", encoded(chat(logit_bias={"5": 500})), 400, "logit_bias"),
    # Messages
    Hostile("unknown role", encoded(chat(messages=[{"role": "wizard", "content": "hi"}])), 400, "messages.0.role"),
    Hostile("role missing", encoded(chat(messages=[{"content": "hi"}])), 400, "messages.0.role"),
    Hostile("no messages", encoded(chat(messages=[])), 400, "messages"),
    Hostile("messages missing", encoded(without(chat(), "messages")), 400, "messages"),
    # Parameters
    Hostile("unknown parameter", encoded(chat(temperatur=0.5)), 400, "temperatur"),
    Hostile("removed guided_json", encoded(chat(guided_json={"type": "object"})), 400, "guided_json"),
    Hostile("model missing", encoded(without(chat(), "model")), 400, "model"),
    Hostile("model not served", encoded(chat(model="gpt-4")), 404, "model"),
    Hostile("model name of 100000 characters", encoded(chat(model="m" * 100_000)), 404, "model"),
    Hostile(
        "unknown parameter named with 100000 characters", encoded(chat(**{"p" * 100_000: 1})), 400, "p" * 100 + "…"
    ),
    Hostile(
        "kv_transfer_params (token ids past the template)",
        encoded(chat(kv_transfer_params={"prompt_token_ids": [1, 2, 3]})),
        400,
        "kv_transfer_params",
    ),
    Hostile(
        "named tool not offered",
        encoded(
            chat(
                tools=[{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}],
                tool_choice={"type": "function", "function": {"name": "b"}},
            )
        ),
        400,
        "tool_choice",
    ),
    # Bodies over 256 KiB are checked in another process, with the same answers
    Hostile("large body, bad parameter", padded(chat(temperature=3)), 400, "temperature"),
    Hostile("large body, unknown parameter", padded(chat(temperatur=0.5)), 400, "temperatur"),
    Hostile("large body, model not served", padded(chat(model="gpt-4")), 404, "model"),
    Hostile("large body, n above max_n", padded(chat(n=9)), 400, "n"),
    Hostile("bad X-Request-Timeout", encoded(chat()), 400, "x-request-timeout", headers={"X-Request-Timeout": "soon"}),
    # Completions
    Hostile("completion without prompt", encoded({"model": MODEL, "max_tokens": 4}), 400, "prompt", COMPLETION_PATH),
    Hostile(
        "completion prompt an object", encoded({"model": MODEL, "prompt": {"a": 1}}), 400, "prompt", COMPLETION_PATH
    ),
    Hostile(
        "completion logprobs 6",
        encoded({"model": MODEL, "prompt": "hi", "logprobs": 6}),
        400,
        "logprobs",
        COMPLETION_PATH,
    ),
    Hostile(
        "completion echo 'no'", encoded({"model": MODEL, "prompt": "hi", "echo": "no"}), 400, "echo", COMPLETION_PATH
    ),
    # Engine sequences: prompts x choices, at most ingress.max_sequences_per_request (8)
    Hostile(
        "completion of 64 prompts with n 8 (512 sequences)",
        encoded({"model": MODEL, "prompt": ["hi"] * 64, "n": 8, "max_tokens": 4}),
        400,
        "prompt",
        COMPLETION_PATH,
    ),
    Hostile(
        "completion of 9 token-id prompts",
        encoded({"model": MODEL, "prompt": [[1, 2]] * 9, "max_tokens": 4}),
        400,
        "prompt",
        COMPLETION_PATH,
    ),
    Hostile(
        "large body, 3 prompts with n 3",
        padded({"model": MODEL, "prompt": ["hi"] * 3, "n": 3, "max_tokens": 4}),
        400,
        "prompt",
        COMPLETION_PATH,
    ),
    # Prompts that cannot fit the context (1024 tokens on the CPU config, 8192 on the simulated one;
    # 16 characters per token), refused before any tokenizer runs
    Hostile(
        "chat prompt of 140000 characters",
        encoded(chat(messages=[{"role": "user", "content": "ab" * 70_000}])),
        400,
        "messages",
    ),
    Hostile(
        "large body, chat prompt of 3 MB",
        encoded(chat(messages=[{"role": "user", "content": "x" * 3_000_000}])),
        400,
        "messages",
    ),
    Hostile(
        "completion of 8193 token ids",
        encoded({"model": MODEL, "prompt": [7] * 8193, "max_tokens": 4}),
        400,
        "prompt",
        COMPLETION_PATH,
    ),
    # vLLM's costly extensions, off unless the config allows them; a text-only model's refusals
    Hostile("use_beam_search", encoded(chat(use_beam_search=True)), 400, "use_beam_search"),
    Hostile(
        "completion prompt_logprobs 20",
        encoded({"model": MODEL, "prompt": "hi", "prompt_logprobs": 20, "max_tokens": 4}),
        400,
        "prompt_logprobs",
        COMPLETION_PATH,
    ),
    Hostile("large body, prompt_logprobs -1", padded(chat(prompt_logprobs=-1)), 400, "prompt_logprobs"),
    # echo asks vLLM for the prompt's log-probabilities too (chat always, a completion with logprobs)
    Hostile("chat echo", encoded(chat(echo=True)), 400, "echo"),
    Hostile(
        "completion echo with logprobs",
        encoded({"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 4}),
        400,
        "echo",
        COMPLETION_PATH,
    ),
    # Log-probabilities per answer: 1000 tokens x (1 + 300 asked) is past ingress.max_logprobs_per_request
    Hostile(
        "logprob_token_ids x max_tokens",
        encoded(chat(logprobs=True, logprob_token_ids=list(range(300)), max_tokens=1000)),
        400,
        "logprob_token_ids",
    ),
    Hostile(
        "large body, logprob_token_ids x max_tokens",
        padded(chat(logprobs=True, logprob_token_ids=list(range(300)), max_tokens=1000)),
        400,
        "logprob_token_ids",
    ),
    # Structured-output specs past ingress.max_grammar_chars (32768 characters of JSON)
    Hostile(
        "response_format of 40 KB", encoded(chat(response_format=json_schema_format(1400))), 400, "response_format"
    ),
    Hostile(
        "large body, structured_outputs of 40 KB",
        padded(chat(structured_outputs={"json": json_schema_format(1400)["json_schema"]["schema"]})),
        400,
        "structured_outputs",
    ),
    # Small specs whose grammars take minutes to build: past ingress.max_grammar_build_s in the checker process
    Hostile(
        "response_format of up to a billion items",
        encoded(chat(response_format=schema_format({"type": "array", "maxItems": BILLION}))),
        400,
        "response_format",
    ),
    Hostile(
        "forced tool call of a billion items",
        encoded(chat(tools=[tool({"type": "array", "minItems": BILLION})], tool_choice="required")),
        400,
        "tools",
    ),
    Hostile(
        "large body, structured_outputs of a billion items",
        padded(chat(structured_outputs={"json": {"type": "array", "minItems": BILLION}})),
        400,
        "structured_outputs",
    ),
    # Lists of tokens past ingress.max_token_list_entries (1024) and ingress.max_bad_words (256)
    Hostile("logit_bias of 2000 tokens", encoded(chat(logit_bias={str(t): 1 for t in range(2000)})), 400, "logit_bias"),
    Hostile("large body, bad_words of 300", padded(chat(bad_words=[f"w{i}" for i in range(300)])), 400, "bad_words"),
    # A client's own place in the engine's queue (vLLM's priority): the server's fair share sets it
    Hostile("priority -1000", encoded(chat(priority=-1000)), 400, "priority"),
    Hostile("large body, priority -1", padded(chat(priority=-1)), 400, "priority"),
    Hostile("mm_processor_kwargs", encoded(chat(mm_processor_kwargs={"num_crops": 4})), 400, "mm_processor_kwargs"),
    Hostile("ec_transfer_params", encoded(chat(ec_transfer_params={"a": 1})), 400, "ec_transfer_params"),
    # The Responses API: what is not served is named (front_door/admission/responses_rules.py), the rest as chat
    Hostile(
        "hosted tool", encoded(responses(tools=[{"type": "web_search_preview"}])), 400, "tools.0.type", RESPONSES_PATH
    ),
    Hostile(
        "image input",
        encoded(
            responses(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://a/b.png"}]}])
        ),
        400,
        "input.0.content.0.type",
        RESPONSES_PATH,
    ),
    Hostile(
        "reasoning item",
        encoded(responses(input=[{"type": "reasoning", "summary": []}])),
        400,
        "input.0.type",
        RESPONSES_PATH,
    ),
    Hostile("unknown item type", encoded(responses(input=[{"type": "banana"}])), 400, "input.0.type", RESPONSES_PATH),
    Hostile("no input", encoded({"model": MODEL}), 400, "input", RESPONSES_PATH),
    Hostile("conversation", encoded(responses(conversation="conv_1")), 400, "conversation", RESPONSES_PATH),
    Hostile("background, not stored", encoded(responses(background=True, store=False)), 400, "store", RESPONSES_PATH),
    Hostile(
        "previous_response_id a number",
        encoded(responses(previous_response_id=5)),
        400,
        "previous_response_id",
        RESPONSES_PATH,
    ),
    Hostile("reasoning effort", encoded(responses(reasoning={"effort": "low"})), 400, "reasoning", RESPONSES_PATH),
    Hostile("max_output_tokens 0", encoded(responses(max_output_tokens=0)), 400, "max_output_tokens", RESPONSES_PATH),
    Hostile(
        "max_output_tokens 5000", encoded(responses(max_output_tokens=5000)), 400, "max_output_tokens", RESPONSES_PATH
    ),
    Hostile("input of 140000 characters", encoded(responses(input="ab" * 70_000)), 400, "input", RESPONSES_PATH),
    Hostile(
        "large body, text.format of a billion items",
        padded(
            responses(
                text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "array", "minItems": BILLION}}}
            )
        ),
        400,
        "text",
        RESPONSES_PATH,
    ),
    Hostile(
        "control mark in a text.format schema",
        encoded(responses(text={"format": {"type": "json_schema", "name": "a", "schema": MARKED}})),
        400,
        "text",
        RESPONSES_PATH,
    ),
    # Routes
    Hostile("GET on a POST route", b"", 405, method="GET"),
    Hostile("unknown route", encoded(chat()), 404, path="/v1/chat/complete"),
]
