"""Every place the app reaches into vLLM past its documented API, in one module.

vLLM's serving classes, engine and metrics are reused as they are; a few of
their internals are read or replaced to finish them for GLM-4 and for serving
under Ray. Each such touch is a function here, named for what it does, so a vLLM
upgrade has one module to review. ``tests/unit/test_vllm_internals.py`` fails on
any vLLM version other than :data:`WRITTEN_AGAINST` and checks that every
attribute named here still exists in the installed vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

WRITTEN_AGAINST = "0.32.0"

# The render steps of vLLM's serving classes: a request rendered and tokenized,
# before the engine sees it (wrapped by serve_app.replica.context_limit).
CHAT_RENDER_STEP = "render_chat_request"
COMPLETION_RENDER_STEP = "render_completion_request"

# The renderer's chat rendering, sync and async (wrapped by serve_app.glm4.serving).
CHAT_RENDER_METHODS = ("render_messages", "render_messages_async")


def prompt_token_count(serving: Any, engine_input: Any) -> int:
    """Tokens in one rendered prompt, as the serving class counts them for usage."""
    return serving._extract_prompt_len(engine_input)


def use_chat_parser(state: Any, parser_cls: type) -> None:
    """Make ``parser_cls`` the parser of the chat serving object and of the online renderer.

    vLLM composes its generic parser around the configured tool parser; no
    argument selects a whole parser class.
    """
    state.openai_serving_chat.parser_cls = parser_cls
    state.online_renderer.parser = parser_cls


def generation_config_fields(engine: Any) -> dict[str, Any]:
    """The generation config the engine's input processor applies to every request (mutable)."""
    return engine.input_processor.generation_config_fields


def engine_core(engine: Any) -> Any:
    """The engine-core client an ``AsyncLLM`` talks to (a simulated engine's core, where one runs)."""
    return engine.engine_core


def fail_engine_requests(engine: Any, error: Exception) -> None:
    """Give every request the engine holds ``error``, as vLLM does when its engine dies."""
    engine.output_processor.propagate_error(error)


@contextlib.contextmanager
def engine_core_replaced(make_core: Callable[[Any, Any], Any]) -> Iterator[None]:
    """While inside, every ``AsyncLLM`` built talks to ``make_core(vllm_config, renderer)``
    instead of starting vLLM's engine-core process.

    ``AsyncLLM`` builds its engine-core client with
    ``EngineCoreClient.make_async_mp_client``; no argument supplies another client,
    so that factory is replaced (process-wide) and restored on leaving.
    """
    from vllm.v1.engine.core_client import EngineCoreClient

    def make_async_mp_client(vllm_config: Any, *args: Any, renderer: Any = None, **kwargs: Any) -> Any:
        return make_core(vllm_config, renderer)

    factory = EngineCoreClient.__dict__["make_async_mp_client"]
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)
    try:
        yield
    finally:
        EngineCoreClient.make_async_mp_client = factory


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

    The logger's ``_gauge_cls`` (vLLM's switch between Prometheus and Ray gauges)
    is replaced; each gauge's Ray metric and tags are ``metric`` and ``_tags``.
    The logger records empty stats at start, so its gauges read 0 before the
    engine's first step, and passes the prefix-cache counters (which vLLM's Ray
    wrapper never increments by 0, so they would appear at the first hit) to
    ``start_counter(metric, tags)``.
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
