"""Every place the app reaches into vLLM past its documented API, in one module.

vLLM's serving classes, engine and metrics are reused as they are; a few of their internals are
read or replaced to finish them for GLM-4 and for serving under Ray. Each such touch is a function
here, named for what it does, so a vLLM upgrade has one module to review. Its unit tests fail on
any vLLM but :data:`WRITTEN_AGAINST` and check that each attribute named here still exists.

Runs in each model replica (and its checker process, and vLLM's processes through the GLM-4 plugin),
and in the application's build (the config's checks).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import logging
import logging.handlers
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

WRITTEN_AGAINST = "0.32.0"

# The render steps of vLLM's serving classes: a request rendered and tokenized,
# before the engine sees it (wrapped by serve_app.engine.context_limit).
CHAT_RENDER_STEP = "render_chat_request"
COMPLETION_RENDER_STEP = "render_completion_request"
RESPONSES_RENDER_STEP = "_render_resolved_response_inputs"  # (private: vLLM's Responses serving has no public one)

# The renderer's chat rendering, sync and async (wrapped by serve_app.glm4.serving).
CHAT_RENDER_METHODS = ("render_messages", "render_messages_async")


# What a serve config's engine_args are checked against when the application is built (serve_app.config),
# read from the installed vLLM's source rather than imported: importing any module of vLLM imports
# torch and its compiler (8 s of CPU in each of Serve's build processes, one per application and
# deploy). tests/unit/test_vllm_internals.py checks each against vLLM's imported value.
ENGINE_ARGS_SOURCE = ("engine/arg_utils.py", "AsyncEngineArgs")  # a dataclass (fields with its bases')
FRONTEND_ARGS_SOURCE = ("entrypoints/launchers/cli_args.py", "FrontendArgs")
QUANTIZATION_SOURCE = ("model_executor/layers/quantization/__init__.py", "QuantizationMethods")  # a Literal
KV_CACHE_DTYPE_SOURCE = ("config/cache.py", "CacheDType")


@functools.cache
def _vllm_source(relative: str) -> ast.Module:
    spec = importlib.util.find_spec("vllm")  # a top-level package: found, not imported
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("vllm")
    return ast.parse((Path(spec.origin).parent / relative).read_text())


def _class_fields(tree: ast.Module, name: str) -> list[str]:
    """A class's annotated fields (a dataclass's), with those of its bases in the same module."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    fields: list[str] = []
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields += _class_fields(tree, base.id)
    for statement in classes[name].body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if "ClassVar" not in ast.unparse(statement.annotation):
                fields.append(statement.target.id)
    return fields


def _literal_values(tree: ast.Module, name: str) -> tuple[str, ...]:
    """The values of a module-level ``name = Literal[...]``."""
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == name for target in statement.targets
        ):
            literal = statement.value
            if isinstance(literal, ast.Subscript):
                values = literal.slice.elts if isinstance(literal.slice, ast.Tuple) else [literal.slice]
                return tuple(v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    raise LookupError(f"{name} = Literal[...] not found")


def engine_argument_names() -> tuple[frozenset[str], frozenset[str]]:
    """Names of vLLM's engine arguments (``AsyncEngineArgs``) and of its OpenAI front end's
    (``FrontendArgs``)."""
    engine = _class_fields(_vllm_source(ENGINE_ARGS_SOURCE[0]), ENGINE_ARGS_SOURCE[1])
    frontend = _class_fields(_vllm_source(FRONTEND_ARGS_SOURCE[0]), FRONTEND_ARGS_SOURCE[1])
    return frozenset(engine), frozenset(frontend)


def quantization_methods() -> tuple[str, ...]:
    """vLLM's quantization methods (``QUANTIZATION_METHODS``)."""
    return _literal_values(_vllm_source(QUANTIZATION_SOURCE[0]), QUANTIZATION_SOURCE[1])


def kv_cache_dtypes() -> tuple[str, ...]:
    """vLLM's KV cache dtypes (``CacheDType``)."""
    return _literal_values(_vllm_source(KV_CACHE_DTYPE_SOURCE[0]), KV_CACHE_DTYPE_SOURCE[1])


def tokenizer_executor(renderer: Any) -> Executor:
    """The thread pool vLLM's renderer tokenizes prompts in (``BaseRenderer._executor``), off the
    event loop: GLM-4's own prompt tokenization (serve_app.glm4.serving) runs there too."""
    executor: Executor = renderer._executor
    return executor


def prompt_token_count(serving: Any, engine_input: Any) -> int:
    """Tokens in one rendered prompt, as the serving class counts them for usage."""
    return serving._extract_prompt_len(engine_input)


def use_chat_parser(state: Any, parser_cls: type) -> None:
    """Make ``parser_cls`` the parser of the chat and Responses serving objects and of the online
    renderer (vLLM composes its generic parser around the configured tool parser; no argument selects
    a whole parser class)."""
    state.openai_serving_chat.parser_cls = parser_cls
    state.openai_serving_responses.parser = parser_cls
    state.online_renderer.parser = parser_cls


def wrap_engine_client(serving: Any, wrap: Callable[[Any], Any]) -> None:
    """Make a serving object call its engine through ``wrap(engine)`` (it keeps it as ``engine_client``)."""
    serving.engine_client = wrap(serving.engine_client)


@contextlib.contextmanager
def process_logging_preserved() -> Iterator[None]:
    """Keep this process's log handlers writing while vLLM builds an engine.

    Building one configures vLLM's logging with ``logging.config.dictConfig``
    (``configure_logging_if_needed``), which closes every handler in the process.
    A closed file handler reopens on its next line, but a closed ``MemoryHandler``
    drops its target, and Serve writes a replica's log through one: every later
    line of the replica (the request log, the engine watch's errors) was lost.
    Each memory handler's target is given back afterwards.
    """
    loggers = [logging.getLogger()] + [
        found for found in logging.Logger.manager.loggerDict.values() if isinstance(found, logging.Logger)
    ]
    targets = {
        handler: handler.target
        for found in loggers
        for handler in found.handlers
        if isinstance(handler, logging.handlers.MemoryHandler) and handler.target is not None
    }
    try:
        yield
    finally:
        for handler, target in targets.items():
            if handler.target is None:
                handler.setTarget(target)


def settle_after_start() -> None:
    """As vLLM's server once its engine is up: ``VLLM_*`` variables read once from now on (the output
    processor read one per output per step), and the startup heap frozen: a full collection walked
    every object the imports made, about 680,000 (0.4 s of stalled loop; docs/performance-history.md)."""
    from vllm import envs
    from vllm.utils.gc_utils import freeze_gc_heap

    envs.enable_envs_cache()
    freeze_gc_heap()


def generation_config_fields(engine: Any) -> dict[str, Any]:
    """The generation config the engine's input processor applies to every request (mutable)."""
    return engine.input_processor.generation_config_fields


def engine_core(engine: Any) -> Any:
    """The engine-core client an ``AsyncLLM`` talks to (a simulated engine's core, where one runs)."""
    return engine.engine_core


def fail_engine_requests(engine: Any, error: Exception) -> None:
    """Give every request the engine holds ``error``, as vLLM does when its engine dies."""
    engine.output_processor.propagate_error(error)


def replace_engine_core(make_core: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """From now on, every ``AsyncLLM`` built talks to ``make_core(vllm_config, renderer)`` instead
    of starting vLLM's engine-core process; returns what puts vLLM's factory back.

    ``AsyncLLM`` builds its engine-core client with ``EngineCoreClient.make_async_mp_client``; no
    argument supplies another client, so that factory is replaced (process-wide).
    """
    from vllm.v1.engine.core_client import EngineCoreClient

    def make_async_mp_client(vllm_config: Any, *args: Any, renderer: Any = None, **kwargs: Any) -> Any:
        return make_core(vllm_config, renderer)

    factory = EngineCoreClient.__dict__["make_async_mp_client"]
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)

    def restore() -> None:
        EngineCoreClient.make_async_mp_client = factory

    return restore


@contextlib.contextmanager
def engine_core_replaced(make_core: Callable[[Any, Any], Any]) -> Iterator[None]:
    """While inside, every ``AsyncLLM`` built talks to ``make_core(vllm_config, renderer)``
    (:func:`replace_engine_core`); vLLM's factory is restored on leaving."""
    restore = replace_engine_core(make_core)
    try:
        yield
    finally:
        restore()


def async_llm_on_core(vllm_config: Any, make_core: Callable[[Any, Any], Any], **async_llm_args: Any) -> Any:
    """vLLM's ``AsyncLLM`` for ``vllm_config`` driving ``make_core(vllm_config, renderer)``'s engine core
    (construction is synchronous: nothing else builds an engine meanwhile)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with engine_core_replaced(make_core):
        return AsyncLLM.from_vllm_config(vllm_config, **async_llm_args)


def ray_stat_logger(
    set_gauge: Callable[[Any, float, dict[str, str]], object],
    start_counter: Callable[[Any, dict[str, str]], object],
) -> type:
    """vLLM's Ray stat logger, its gauges set through ``set_gauge(metric, value, tags)``.

    The logger's ``_gauge_cls`` (vLLM's switch between Prometheus and Ray gauges) is replaced;
    each gauge's Ray metric and tags are ``metric`` and ``_tags``. The logger records empty stats
    at start, so its gauges read 0 before the engine's first step, and passes the prefix-cache
    counters (which vLLM's Ray wrapper never increments by 0, so they would appear at the first
    hit) to ``start_counter(metric, tags)``.
    """
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper, RayPrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    class SetThroughGauge(RayGaugeWrapper):
        def set(self, value: int | float) -> None:
            set_gauge(self.metric, value, self._tags)

    class StatLogger(RayPrometheusStatLogger):
        _gauge_cls = SetThroughGauge

        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            super().__init__(vllm_config, engine_indexes)
            for index in self.engine_indexes:  # (vLLM's counters skip increments of 0)
                self.record(SchedulerStats(), None, engine_idx=index)
                for counter in (self.counter_prefix_cache_queries[index], self.counter_prefix_cache_hits[index]):
                    start_counter(counter.metric, counter._tags)

    return StatLogger


# Tokenizers already made for llguidance, by the id of the tokenizer they were made from and
# their settings (one per engine process, and one for the front end's validation).
_llguidance_tokenizers: dict[tuple[int, int, str], Any] = {}


def llguidance_tokenizer(tokenizer: Any, vocab_size: int, not_in_text: str) -> Any:
    """llguidance's tokenizer for a Hugging Face ``tokenizer``, in which text stays text.

    llguidance 1.7 tokenizes the bytes a grammar forces (a schema's ``const``, a regex's
    literal) with the Hugging Face tokenizer, which reads the text ``<|user|>`` as the
    control token: the mask then allows the control token, accepting it fails, and vLLM
    ends the request with an error (a 500). Here each special token's text is prefixed
    with ``not_in_text`` (a character requests may not carry) before llguidance reads the
    tokenizer, so forced text is written as text; the control tokens keep their ids, and
    a Lark grammar names them by id (``<[151336]>``). ``tests/unit/config/test_structured_outputs.py``
    fails once llguidance no longer needs it.
    """
    import copy
    import json

    import llguidance

    key = (id(tokenizer), vocab_size, not_in_text)
    if key not in _llguidance_tokenizers:
        backend = copy.copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer reads it
        backend.no_padding()
        backend.no_truncation()
        spec = json.loads(backend.to_str())
        vocab = spec["model"].get("vocab")  # a token also in the model's vocabulary keeps its text
        for token in spec["added_tokens"]:
            if token["special"] and not (isinstance(vocab, dict) and token["content"] in vocab):
                token["content"] = not_in_text + token["content"]
        _llguidance_tokenizers[key] = llguidance.LLTokenizer(
            json.dumps(spec), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
        )
    return _llguidance_tokenizers[key]


def guidance_reads_text_as_text(not_in_text: str) -> None:
    """Make vLLM's guidance backend, and its validation of requests, use :func:`llguidance_tokenizer`
    with special tokens' text prefixed by ``not_in_text``.

    Run in every vLLM process (the replica's front end and its engine core) by GLM-4's vLLM
    plugin (:mod:`serve_app.glm4.vllm_plugin`). Mistral's tokenizers keep vLLM's own path.
    """
    import vllm.sampling_params
    from vllm.utils.mistral import is_mistral_tokenizer
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend

    if getattr(GuidanceBackend._build_ll_tokenizer, "reads_text_as_text", False):
        return  # (vLLM loads its plugins more than once in a process)
    vllm_builder = GuidanceBackend.__dict__["_build_ll_tokenizer"].__func__
    vllm_validation_tokenizer = vllm.sampling_params._get_llg_tokenizer

    def build(tokenizer: Any, vocab_size: int) -> Any:
        if is_mistral_tokenizer(tokenizer):
            return vllm_builder(tokenizer, vocab_size)
        return llguidance_tokenizer(tokenizer, max(vocab_size, len(tokenizer)), not_in_text)

    def validation_tokenizer(tokenizer: Any) -> Any:
        if is_mistral_tokenizer(tokenizer):
            return vllm_validation_tokenizer(tokenizer)
        return llguidance_tokenizer(tokenizer, len(tokenizer), not_in_text)

    build.reads_text_as_text = True  # type: ignore[attr-defined]
    GuidanceBackend._build_ll_tokenizer = staticmethod(build)
    vllm.sampling_params._get_llg_tokenizer = validation_tokenizer


def warm_structured_output_validation(tokenizer: Any) -> None:
    """Build the front end's llguidance tokenizer now rather than in the first structured
    request (about 2 s for GLM-4's 151,552 tokens on a slow CPU; blocking: call it in a thread)."""
    import vllm.sampling_params

    vllm.sampling_params._get_llg_tokenizer(tokenizer)


class _ByteTokens:
    """A tokenizer of the 256 bytes and an end token, for llguidance (its ``TokenizerWrapper``'s fields)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))


def build_request_grammar(request: Any) -> str | None:
    """Build a validated chat, completion or Responses API request's grammar as vLLM will, and return the error its
    engine would meet, if the client can be told (else None).

    The steps are vLLM's: the JSON schema a forced tool call adds (``ToolParser.adjust_request``),
    the sampling parameters, the front end's validation (``validate_guidance_grammar``, whose
    errors the replica answers with vLLM's message), then the engine's ``LLMatcher``, with the
    serve configs' ``structured_outputs_config``. A matcher that fails to build leaves vLLM's engine
    a mask of only the end token (the answer empty, a 200), so its error is returned, but only for
    JSON schemas, regexes and choices: the matcher here has a stand-in tokenizer of bytes, and
    a Lark grammar may name the model's own special tokens."""
    import llguidance
    from openai.types.responses import ResponseFormatTextJSONSchemaConfig, ResponseTextConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tool_parsers.utils import get_json_schema_from_tools
    from vllm.v1.structured_output.backend_guidance import serialize_guidance_grammar, validate_guidance_grammar
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.request import get_structured_output_key

    try:
        if isinstance(request, ChatCompletionRequest | ResponsesRequest):
            schema = get_json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls)
            if schema is not None and isinstance(request, ChatCompletionRequest):
                request.structured_outputs = StructuredOutputsParams(json=schema)
                request.response_format = None
            elif schema is not None:  # as vLLM's ToolParser.adjust_request sets it
                request.text = ResponseTextConfig(
                    format=ResponseFormatTextJSONSchemaConfig(
                        type="json_schema", name="tool_calling_response", schema=schema, strict=True
                    )
                )
        params = request.to_sampling_params(1, default_sampling_params={})
        if params.structured_outputs is None:
            return None
        validate_guidance_grammar(params, tokenizer=None)
        kind, spec = get_structured_output_key(params.structured_outputs)
        grammar = serialize_guidance_grammar(
            kind, spec, disable_any_whitespace=True, disable_additional_properties=True
        )
    except (ValueError, TypeError, KeyError, VLLMClientError):
        return None  # refused by the replica, with vLLM's own message
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    error = matcher.get_error()
    tokenizer_free = kind in (
        StructuredOutputOptions.JSON,
        StructuredOutputOptions.REGEX,
        StructuredOutputOptions.CHOICE,
    )
    return error.split("\n")[0] if error and tokenizer_free else None
