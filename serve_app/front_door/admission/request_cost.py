"""What one request may cost the engine, bounded before any tokenizer, grammar compiler or replica sees it.

Serve's concurrency limits and the autoscaler count a request as one, whatever it
asks of the engine: 64 prompts with ``n`` 8 are 512 sequences in a batch of 64;
``top_logprobs`` 20 over 8192 tokens and 8 choices is 1.4 million log-probabilities
in one unary answer; a 3 MB prompt is seconds of tokenizing; prompt log-probabilities
take a vocabulary-wide distribution for every prompt token; each of ``bad_words`` is
checked in Python at every step of the batch. :func:`measure` reads
what such costs depend on from a decoded body (in the large-body checker's process
when the body is large), and :func:`check_costs` holds it to the serve config's
limits (:class:`CostLimits`), each refusal a 400 naming the parameter and the limit.
docs/api-behaviour.md states every rule.

Runs in each model replica.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.config import IngressConfig, PromptLogprobsConfig
from serve_app.errors import APIError


@dataclass(frozen=True)
class CostLimits:
    """The serve config's bounds on one request (``ingress.*``, read by :meth:`from_config`)."""

    max_n: int = 8  # most choices one request may ask for
    max_sequences: int = 8  # most engine sequences one request may start: prompts x choices
    max_prompt_chars_per_token: int = 16  # a prompt's characters at most max_model_len times this
    allow_beam_search: bool = False  # vLLM's use_beam_search
    prompt_logprobs: PromptLogprobsConfig | None = None  # None: refused
    max_logprobs: int = 200_000  # log-probabilities one answer may carry
    max_grammar_chars: int = 32_768  # characters of JSON in a request's structured-output specs
    max_grammar_build_s: float | None = None  # longest a grammar may take to build first; None: not built first
    max_token_list_entries: int = 1024  # entries in logit_bias, allowed_token_ids, stop_token_ids each
    max_bad_words: int = 256  # entries in bad_words

    @classmethod
    def from_config(cls, ingress: IngressConfig) -> CostLimits:
        return cls(
            max_n=ingress.max_n,
            max_sequences=ingress.max_sequences_per_request,
            max_prompt_chars_per_token=ingress.max_prompt_chars_per_token,
            allow_beam_search=ingress.allow_beam_search,
            prompt_logprobs=ingress.prompt_logprobs,
            max_logprobs=ingress.max_logprobs_per_request,
            max_grammar_chars=ingress.max_grammar_chars,
            max_grammar_build_s=ingress.max_grammar_build_s,
            max_token_list_entries=ingress.max_token_list_entries,
            max_bad_words=ingress.max_bad_words,
        )


@dataclass(frozen=True)
class PromptSize:
    """A request's prompts before any tokenizer sees them: how many, and the longest's characters of
    text (messages and tools, or a completion prompt) and token ids sent as ids."""

    prompts: int
    characters: int
    token_ids: int
    param: str  # what a refusal names: "messages" or "prompt"


@dataclass(frozen=True)
class Asked:
    """A costly option a request asks for: the parameter that asks, and how many per token it asks."""

    param: str
    count: int


@dataclass(frozen=True)
class BodySize:
    """What a body's costs depend on, measured where it was decoded (:func:`measure`)."""

    prompt: PromptSize
    grammar_chars: int = 0  # characters of JSON of its structured-output specs
    grammar_param: str = "response_format"  # the largest of them, named by a refusal
    logprobs: Asked | None = None  # log-probabilities per generated token
    prompt_logprobs: Asked | None = None  # per prompt token (vLLM's prompt_logprobs, or echo's)
    token_list: Asked | None = None  # the longest of its lists of tokens, and its entries
    bad_words: int = 0


def measure(body: dict[str, Any]) -> BodySize:
    grammar = grammar_specs(body)
    largest = max(grammar, key=grammar.__getitem__, default="response_format")
    return BodySize(
        prompt_size(body),
        sum(grammar.values()),
        largest,
        logprobs_asked(body),
        prompt_logprobs_asked(body),
        longest_token_list(body),
        _entries(body.get("bad_words")),
    )


def check_costs(
    body: dict[str, Any],
    size: BodySize,
    limits: CostLimits,
    max_model_len: int | None,
    max_output_tokens: int | None,
) -> None:
    """Every bound on one request, in the order a client would fix them."""
    check_prompt_size(size.prompt, max_model_len, limits.max_prompt_chars_per_token)
    check_output_fits(body, max_model_len, max_output_tokens)
    check_choices(body, limits.max_n)
    check_sequences(body, size.prompt.prompts, limits.max_sequences)
    check_extensions(body, limits.allow_beam_search)
    check_prompt_logprobs(size, limits.prompt_logprobs, limits.max_prompt_chars_per_token)
    check_logprobs(body, size, limits.max_logprobs, max_output_tokens or max_model_len)
    check_grammar_size(size, limits.max_grammar_chars)
    check_token_lists(size, limits.max_token_list_entries, limits.max_bad_words)


def check_output_fits(body: dict[str, Any], max_model_len: int | None, max_output_tokens: int | None = None) -> None:
    """A ``max_tokens`` above the model's ceiling or its whole context: 400 before any replica sees it.

    (The replica then checks prompt plus ``max_tokens``, which needs the prompt's tokens.)
    """
    for name in OUTPUT_LENGTHS:
        value = body.get(name)
        if type(value) is not int:
            continue
        if max_output_tokens is not None and value > max_output_tokens:
            raise APIError(
                400, f"{name} is {value}; this server answers with at most {max_output_tokens} tokens", param=name
            )
        if max_model_len is not None and value > max_model_len:
            raise APIError(400, f"{name} is {value}; the model's context is {max_model_len} tokens", param=name)


OUTPUT_LENGTHS = ("max_completion_tokens", "max_tokens", "max_output_tokens")  # (the last: the Responses API's)


def check_choices(body: dict[str, Any], max_n: int) -> None:
    """Each choice is a sequence in the engine's batch: one request may not take the whole batch."""
    n = body.get("n")
    if type(n) is int and n > max_n:
        raise APIError(400, f"n is {n}; this server answers at most {max_n} choices per request", param="n")


def _characters(value: Any) -> int:
    """Characters of every string in a JSON value, keys included (tools' names are rendered too)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _characters(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_characters(item) for item in value)
    return 0


def prompt_size(body: dict[str, Any]) -> PromptSize:
    """The prompts a request will render, counted (:func:`prompt_count`) and measured."""
    if "messages" in body:
        return PromptSize(1, _characters(body["messages"]) + _characters(body.get("tools")), 0, "messages")
    if "input" in body:  # the Responses API's
        rendered = _characters(body["input"]) + _characters(body.get("instructions")) + _characters(body.get("tools"))
        return PromptSize(1, rendered, 0, "input")
    prompts = _prompt_list(body)
    texts = [p for p in prompts if isinstance(p, str)]
    ids = [p for p in prompts if isinstance(p, list)]
    return PromptSize(len(prompts), max(map(len, texts), default=0), max(map(len, ids), default=0), "prompt")


def check_prompt_size(size: PromptSize, max_model_len: int | None, chars_per_token: int) -> None:
    """400 before any tokenizer runs for a prompt that cannot fit the context: more token ids than
    ``max_model_len``, or more characters than ``max_model_len`` tokens of ``chars_per_token`` each."""
    if max_model_len is None:
        return
    if size.token_ids > max_model_len:
        raise APIError(
            400,
            f"the prompt has {size.token_ids} token ids; the model's context is {max_model_len} tokens",
            param=size.param,
        )
    limit = max_model_len * chars_per_token
    if size.characters > limit:
        raise APIError(
            400,
            f"the prompt has {size.characters} characters; at most {limit} can fit the model's context of "
            f"{max_model_len} tokens (at {chars_per_token} characters per token)",
            param=size.param,
        )


def check_extensions(body: dict[str, Any], allow_beam_search: bool) -> None:
    """vLLM's beam search, off unless the config allows it (``ingress.allow_beam_search``), and its
    ``priority``, which is the server's."""
    if body.get("use_beam_search") is True and not allow_beam_search:
        raise APIError(400, "use_beam_search is off on this server", param="use_beam_search")
    if body.get("priority", 0) != 0:  # (vLLM's field; the server sets it: serve_app.front_door.admission.capacity)
        raise APIError(
            400,
            "priority is set by this server (each API key's waiting requests go by how many it holds); omit it",
            param="priority",
        )


def prompt_logprobs_asked(body: dict[str, Any]) -> Asked | None:
    """The prompt log-probabilities vLLM will compute for a request: its ``prompt_logprobs``, or with
    ``echo`` (which vLLM answers with them) chat's ``top_logprobs`` (0 unset) or a completion's ``logprobs``."""
    asked = body.get("prompt_logprobs")
    if asked is not None:
        return Asked("prompt_logprobs", asked if type(asked) is int else 0)
    if body.get("echo") is not True:
        return None
    if "messages" in body:
        top = body.get("top_logprobs")
        return Asked("echo", top if type(top) is int else 0)
    logprobs = body.get("logprobs")
    return Asked("echo", logprobs) if type(logprobs) is int else None


def check_prompt_logprobs(size: BodySize, allowed: PromptLogprobsConfig | None, chars_per_token: int) -> None:
    """Prompt log-probabilities only as far as ``ingress.prompt_logprobs`` allows: a count up to its
    ``max_logprobs``, on a prompt of at most ``max_prompt_tokens`` (here by characters and token ids;
    the replica counts the tokens, :mod:`serve_app.engine.context_limit`)."""
    asked = size.prompt_logprobs
    if asked is None:
        return
    if allowed is None:
        because = " (vLLM computes them for echo)" if asked.param == "echo" else ""
        raise APIError(400, f"prompt log-probabilities{because} are off on this server", param=asked.param)
    if not 0 <= asked.count <= allowed.max_logprobs:  # vLLM reads -1 as the whole vocabulary
        raise APIError(
            400,
            f"{asked.param} asks for {asked.count} prompt log-probabilities per token; "
            f"it must be between 0 and {allowed.max_logprobs}",
            param=asked.param,
        )
    prompt, most = size.prompt, allowed.max_prompt_tokens
    if prompt.token_ids > most or prompt.characters > most * chars_per_token:
        measured = f"{prompt.token_ids} token ids" if prompt.token_ids > most else f"{prompt.characters} characters"
        raise APIError(
            400,
            f"prompt log-probabilities are computed for prompts of at most {most} tokens "
            f"({most * chars_per_token} characters); the prompt has {measured}",
            param=prompt.param,
        )


def logprobs_asked(body: dict[str, Any]) -> Asked | None:
    """The log-probabilities each generated token carries: its own, and chat's ``top_logprobs`` (with
    ``logprobs: true``) or a completion's ``logprobs``, or instead ``logprob_token_ids``'s."""
    logprobs = body.get("logprobs")
    if "input" in body:  # the Responses API's: asked for by include
        if "message.output_text.logprobs" not in (body.get("include") or ()):
            return None
        top = body.get("top_logprobs")
        return Asked("top_logprobs", 1 + (top if type(top) is int and top > 0 else 0))
    if "messages" in body:
        if logprobs is not True:
            return None
        param, top = "top_logprobs", body.get("top_logprobs")
    else:
        if type(logprobs) is not int:
            return None
        param, top = "logprobs", logprobs
    ids = body.get("logprob_token_ids")
    if isinstance(ids, list) and ids:  # vLLM returns these instead of the top ones
        return Asked("logprob_token_ids", 1 + len(ids))
    return Asked(param, 1 + (top if type(top) is int and top > 0 else 0))


def check_logprobs(body: dict[str, Any], size: BodySize, max_logprobs: int, default_tokens: int | None) -> None:
    """A bound on the log-probabilities one answer carries: sequences x tokens x per token."""
    asked = size.logprobs
    if asked is None:
        return
    tokens = next((body[k] for k in OUTPUT_LENGTHS if type(body.get(k)) is int), None)
    tokens = tokens if tokens is not None else default_tokens
    if tokens is None:
        return
    sequences = engine_sequences(body, size.prompt.prompts)
    total = sequences * tokens * asked.count
    if total > max_logprobs:
        raise APIError(
            400,
            f"{asked.param} asks for up to {total} log-probabilities ({sequences} sequences x {tokens} tokens "
            f"x {asked.count} each); this server returns at most {max_logprobs} per request: lower max_tokens, "
            f"n or {asked.param}",
            param=asked.param,
        )


def grammar_specs(body: dict[str, Any]) -> dict[str, int]:
    """Characters of JSON of each structured-output spec a grammar is built from: ``response_format``,
    ``structured_outputs``, the Responses API's ``text`` format, and ``tools`` when ``tool_choice`` forces a call."""
    names = ["response_format", "structured_outputs"]
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type") != "text":
        names.append("text")
    if body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict):
        names.append("tools")
    return {
        name: len(json.dumps(body[name], ensure_ascii=False, separators=(",", ":")))
        for name in names
        if body.get(name) is not None
    }


def check_grammar_size(size: BodySize, max_chars: int) -> None:
    if size.grammar_chars > max_chars:
        raise APIError(
            400,
            f"the structured-output specs take {size.grammar_chars} characters of JSON; this server builds "
            f"grammars from at most {max_chars}",
            param=size.grammar_param,
        )


TOKEN_LISTS = ("logit_bias", "allowed_token_ids", "stop_token_ids")


def _entries(value: Any) -> int:
    return len(value) if isinstance(value, (list, dict)) else 0


def longest_token_list(body: dict[str, Any]) -> Asked | None:
    """The longest of a request's lists of tokens (:data:`TOKEN_LISTS`), None if it sends none."""
    lists = [Asked(name, _entries(body.get(name))) for name in TOKEN_LISTS if body.get(name)]
    return max(lists, key=lambda asked: asked.count, default=None)


def check_token_lists(size: BodySize, max_entries: int, max_bad_words: int) -> None:
    if size.token_list is not None and size.token_list.count > max_entries:
        raise APIError(
            400,
            f"{size.token_list.param} has {size.token_list.count} entries; this server takes at most {max_entries}",
            param=size.token_list.param,
        )
    if size.bad_words > max_bad_words:
        raise APIError(
            400,
            f"bad_words has {size.bad_words} words; the engine checks each at every step, and this server "
            f"takes at most {max_bad_words}",
            param="bad_words",
        )


def _prompt_list(body: dict[str, Any]) -> list[Any]:
    """A request's prompts: a /v1/completions ``prompt`` may be a list of texts or of token-id lists,
    each its own prompt (a list of token ids is one prompt); anything else is one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


def prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a request carries (chat has one)."""
    return len(_prompt_list(body))


def engine_sequences(body: dict[str, Any], prompts: int) -> int:
    """The sequences a request starts in the engine: each prompt's each choice."""
    n = body.get("n")
    return prompts * (n if type(n) is int and n > 0 else 1)


def check_sequences(body: dict[str, Any], prompts: int, max_sequences: int) -> None:
    """Each prompt's each choice is a sequence in the engine's batch, while Serve's limits and
    the autoscaler count the request as one: a request may start at most ``max_sequences``."""
    sequences = engine_sequences(body, prompts)
    if sequences <= max_sequences:
        return
    choices = sequences // prompts
    if prompts == 1:
        raise APIError(
            400, f"n is {choices}; this server runs at most {max_sequences} sequences per request", param="n"
        )
    asked = f"{prompts} prompts" + (f" with n {choices}" if choices > 1 else "")
    raise APIError(
        400,
        f"prompt has {asked}, {sequences} sequences; this server runs at most {max_sequences} per request",
        param="prompt",
    )
