"""EngineServer: the engine half of a model replica, one vLLM ``AsyncLLM``. Runs in each model replica.

The engine and vLLM's OpenAI serving objects are built by :mod:`serve_app.engine.build`
(chat templates, sampling parameters, usage, logprobs and SSE chunk framing are vLLM's own,
finished for GLM-4 by :mod:`serve_app.glm4.serving`). This module adapts them to the front
door's calls: it answers each with the generator protocol of :mod:`serve_app.protocol`, and
exposes the engine's health to Serve's health checks. With ``simulated_engine`` in the
model's config the replica also follows the cluster's simulation switchboard (tests drive
its engine through it); nothing else here changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import ray
from pydantic import BaseModel
from ray import serve

from serve_app import vllm_internals
from serve_app.config import ModelConfig, PromptLogprobsConfig
from serve_app.engine.build import build_engine, engine_config, serving_state
from serve_app.engine.engine_watch import EngineProgress, EngineWatch
from serve_app.engine.responses_stream import ResponseEcho, ResponsesStream, StreamBatchingEngine, response_outcome
from serve_app.engine.stream_transforms import OutcomeTap, end_on_error_event, normalize_error_event
from serve_app.errors import ENGINE_FAILED, UNAVAILABLE, sse_error_event
from serve_app.observability import tracing
from serve_app.observability.engine_metrics import engine_stat_logger, report_engine_info
from serve_app.protocol import AnswerItem, Outcome, PickledRequest, WholeAnswer, empty_kind, is_error_event

if TYPE_CHECKING:
    from serve_app.simulated_engine.core import SimulatedEngineCore

logger = logging.getLogger("ray.serve")


class EngineServer:
    """The engine half of a model replica: one model's chat and text completions from a vLLM engine.

    Built with :meth:`start` by the model deployment
    (:class:`~serve_app.deployments.model_server.ModelServer`), which calls it in-process.
    """

    def __init__(self, model: ModelConfig) -> None:
        self.model_name = model.name
        self.stream_batching = model.stream_batching
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    @classmethod
    async def start(cls, model: ModelConfig, prompt_logprobs: PromptLogprobsConfig | None = None) -> EngineServer:
        """The engine of ``model`` built (:mod:`serve_app.engine.build`), loaded and watched."""
        server = cls(model)
        await server._start(model, prompt_logprobs)
        return server

    async def _start(self, model: ModelConfig, prompt_logprobs: PromptLogprobsConfig | None) -> None:
        from serve_app.simulated_engine import switchboard

        tracing.configure_tracing()
        progress = EngineProgress()
        config = engine_config(model)
        report_engine_info(model.name, config.vllm_config)
        # vLLM's own engine metrics, exported through Ray's metrics (ray_vllm:*, tagged with
        # this replica's id; gauges kept while idle), and the engine watch's progress.
        self.engine = build_engine(config, [engine_stat_logger(), progress_stat_logger(progress)])
        self.simulated_core: SimulatedEngineCore | None = None
        if model.simulated_engine is not None:
            self.simulated_core = vllm_internals.engine_core(self.engine)
            # Tests drive it through the cluster's switchboard, which reaches a full replica too.
            self._follow_controls = asyncio.get_running_loop().create_task(
                switchboard.follow(ray.get_runtime_context().get_actor_id(), self.simulated_core.control)
            )
            await asyncio.sleep(model.simulated_engine.load_s)  # the model's load time
        # (ingress.prompt_logprobs: the longest prompt whose log-probabilities are computed, in tokens)
        logprobs_prompt_tokens = prompt_logprobs.max_prompt_tokens if prompt_logprobs is not None else None
        state = await serving_state(self.engine, config, logprobs_prompt_tokens)
        self.chat_serving = state.openai_serving_chat
        self.completion_serving = state.openai_serving_completion
        self.responses_serving = state.openai_serving_responses
        batching = self.stream_batching.tokens_per_chunk
        vllm_internals.wrap_engine_client(self.responses_serving, lambda e: StreamBatchingEngine(e, batching))
        self.max_model_len = config.vllm_config.model_config.max_model_len
        self.watch = EngineWatch(
            engine_dead=lambda: self.engine.errored,
            leave=self._leave,
            held=self.engine.get_num_unfinished_requests,
            fail_requests=self._fail_requests,
            stall_timeout_s=model.engine_stall_timeout_s,
            progress=progress,
        )
        self.watch.start()
        vllm_internals.settle_after_start()
        logger.info(
            "model %s ready (max_model_len=%d, eos/stop token ids=%s)",
            model.name,
            self.max_model_len,
            state.stop_token_ids,
        )

    async def chat(self, request: Any, trace_context: dict[str, str] | None = None) -> AsyncGenerator[AnswerItem, None]:
        """Answer a validated ``ChatCompletionRequest``; ``trace_context`` continues the front door's trace."""
        async for item in self._answer("chat", self.chat_serving.create_chat_completion, request, trace_context):
            yield item

    async def completion(
        self, request: Any, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[AnswerItem, None]:
        """Answer a validated ``CompletionRequest``; ``trace_context`` continues the front door's trace."""
        async for item in self._answer("completion", self.completion_serving.create_completion, request, trace_context):
            yield item

    async def responses(
        self, request: Any, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[AnswerItem, None]:
        """Answer a validated ``ResponsesRequest`` (OpenAI's Responses API); ``trace_context`` as for chat."""
        async for item in self._answer("responses", self.responses_serving.create_responses, request, trace_context):
            yield item

    async def _answer(
        self, endpoint: str, create: Any, request: Any, trace_context: dict[str, str] | None
    ) -> AsyncIterator[AnswerItem]:
        if isinstance(request, PickledRequest):  # a large body, validated in the front door's checker process
            request = request.load()
        span = tracing.start_engine_span(
            f"{endpoint} {self.model_name}",
            trace_context,
            {
                "gen_ai.request.model": self.model_name,
                "gen_ai.response.id": request.request_id,
                "serve.replica_id": self.replica_id,
            },
        )
        started = time.monotonic()
        outcome: Outcome | None = None
        first_at: float | None = None
        with self.watch.call():
            try:
                async for item in self._generate(create, request, responses=endpoint == "responses"):
                    if isinstance(item, Outcome):
                        outcome = item
                    elif first_at is None and isinstance(item, str):  # a stream's first chunk
                        first_at = time.monotonic()
                    yield item
            finally:
                _close_engine_span(span, outcome, first_at - started if first_at is not None else None)

    async def _generate(self, create: Any, request: Any, responses: bool = False) -> AsyncIterator[AnswerItem]:
        """vLLM's answer as a :class:`WholeAnswer` or SSE chunks; a stream ends with its :class:`Outcome`.

        ``responses``: a Responses API request, whose stream vLLM gives as event objects
        (:mod:`serve_app.engine.responses_stream`)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        if self.watch.failed:
            yield _unavailable()
            return
        streaming = bool(getattr(request, "stream", False))
        request, echo = ResponseEcho.split(request) if responses else (request, None)
        tap = _outcome_tap(request) if streaming and not responses else None
        framed = ResponsesStream(self._stream_failure, echo) if streaming and responses else None
        if tap is not None and request.stream_interval is None:  # see StreamBatchingConfig
            held = self.engine.get_num_unfinished_requests()
            request.stream_interval = self.stream_batching.tokens_per_chunk(held)
        try:
            result = await create(request)
        except Exception as exc:  # vLLM maps its exceptions to statuses; so do we
            result = create_error_response(exc)
        if isinstance(result, ErrorResponse):
            # The engine died while it held this request, which may be what killed it: not retryable.
            yield (
                _engine_failed()
                if self.watch.failed
                else WholeAnswer.error(result.error.code, result.error.message, result.error.param)
            )
        elif isinstance(result, BaseModel):
            if echo is not None:
                echo.apply(result)
            outcome = response_outcome(result) if responses else _outcome_of(result)
            yield WholeAnswer(200, result.model_dump_json(by_alias=responses).encode(), outcome)
        else:
            if framed is not None:
                events = framed.frames(result)
            else:
                assert tap is not None
                events = tap.tap(end_on_error_event(result, rewrite=self._error_event))
            async with aclosing(events) as stream:
                first = await anext(stream, None)
                if first is not None and is_error_event(first) and self.watch.failed:
                    yield _engine_failed()  # before the first token: still a status, not a stream
                    return
                if first is not None:
                    yield first
                async for chunk in stream:
                    yield chunk
            outcome = framed.outcome if framed is not None else tap.outcome if tap is not None else None
            if outcome is not None:
                yield outcome

    def _stream_failure(self) -> tuple[int, str, str | None]:
        """The error a stream that broke after it began ends with: the engine's death, if it died."""
        if self.watch.failed:
            return _ENGINE_FAILED_ERROR
        return 500, "the answer failed while it was generated", "internal_error"

    def _error_event(self, chunk: str) -> str:
        """A stream's error event; when the engine died or hung under it, it says so (``engine_failed``)."""
        if self.watch.failed:
            return sse_error_event(*_ENGINE_FAILED_ERROR).decode()
        return normalize_error_event(chunk)

    async def ping(self) -> str:
        """The model's name, once the engine is healthy: for operators and tests with a handle
        (``/health`` reads Serve's status instead, never a replica)."""
        await self.check_health()
        return self.model_name

    async def in_flight(self) -> int:
        """Requests this replica's engine still holds (running or waiting).

        Read through a deployment handle by operators and by the tests that
        prove abandoned and timed-out requests are aborted.
        """
        return self.engine.get_num_unfinished_requests()

    async def engine_load(self) -> tuple[str, int]:
        """This replica's Ray actor id and the requests its engine holds: which replica is busy.

        For operators, and for the autoscale test, which kills the engine of a replica
        seen holding requests (Serve's router may leave one replica idle for a while).
        """
        return ray.get_runtime_context().get_actor_id(), await self.in_flight()

    async def check_health(self) -> None:
        """Serve's health check: a dead or hung engine makes Serve replace this replica (if it has not left)."""
        if self.watch.stalled:
            raise RuntimeError("the vLLM engine is hung: it holds requests and produces no output")
        await self.engine.check_health()

    def _fail_requests(self) -> None:
        """Give every request the hung engine holds an error, as vLLM does when its engine dies."""
        from vllm.v1.engine.exceptions import EngineDeadError

        vllm_internals.fail_engine_requests(self.engine, EngineDeadError("the engine stopped making progress"))

    def _leave(self) -> None:
        """Its engine died or hung: stop the engine, but keep the process.

        HAProxy and the picker keep sending this replica requests until Serve, whose
        health check of it now fails, takes it out and stops it (draining what it
        holds); until then its front door sends each one on to the other replicas.
        Exiting at once cut the requests in flight here: HAProxy's plain-text 500.
        """
        self.engine.shutdown()

    def stop(self) -> None:
        """Serve is stopping this replica: the engine's shutdown is no death."""
        watch = getattr(self, "watch", None)
        if watch is not None:
            watch.stopping = True
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def progress_stat_logger(progress: EngineProgress) -> Any:
    """A vLLM stat logger (vLLM calls ``record`` after every engine step) that feeds ``progress``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineProgressLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            progress.saw_output()

        def log_engine_initialized(self) -> None:
            pass

    return EngineProgressLogger


def _outcome_tap(request: Any) -> OutcomeTap:
    """Turn the usage chunk on for a stream, remembering whether its client asked for it."""
    from vllm.entrypoints.generate.base.protocol import StreamOptions

    options = request.stream_options
    client_asked = bool(options and options.include_usage)
    if not client_asked:  # (continuous usage has no effect without include_usage: keep it off)
        request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=False)
    return OutcomeTap(client_asked)


def _outcome_of(result: BaseModel) -> Outcome | None:
    usage = getattr(result, "usage", None)
    if usage is None:
        return None
    choices = getattr(result, "choices", ())
    reasons = tuple(c.finish_reason for c in choices if getattr(c, "finish_reason", None))
    messages = [getattr(c, "message", None) for c in choices]
    texts = [getattr(m, "content", None) for m in messages] + [getattr(c, "text", None) for c in choices]
    calls = [call for m in messages for call in (getattr(m, "tool_calls", None) or ())]
    empty = empty_kind(reasons, any(texts), bool(calls), any(call.function.arguments for call in calls))
    return Outcome(usage.prompt_tokens, usage.completion_tokens or 0, reasons, empty)


def _close_engine_span(span: Any, outcome: Outcome | None, ttft_s: float | None) -> None:
    if not span.is_recording():
        return
    if ttft_s is not None:
        span.set_attribute("llm.time_to_first_token_s", ttft_s)
    if outcome is not None:
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": outcome.prompt_tokens,
                "gen_ai.usage.output_tokens": outcome.completion_tokens,
                "gen_ai.response.finish_reasons": list(outcome.finish_reasons),
            }
        )
    span.end()


def _unavailable() -> WholeAnswer:
    """Refused before the engine saw it (the engine was already dead): the front door sends it
    again, and this replica exits within seconds, so the retry lands on another (EngineWatch)."""
    return WholeAnswer.error(503, "the model engine on this replica died; retry shortly", code=UNAVAILABLE)


_ENGINE_FAILED_ERROR = (
    500,
    "the model engine failed while it was generating this answer; the request was not retried, "
    "in case it caused the failure",
    ENGINE_FAILED,
)


def _engine_failed() -> WholeAnswer:
    """The engine died while it held this request. The request may be what killed it (vLLM
    has had inputs that crash it), so it is answered, once, and never sent to another replica."""
    status, message, code = _ENGINE_FAILED_ERROR
    return WholeAnswer.error(status, message, code=code)
