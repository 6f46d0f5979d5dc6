"""The vLLM stack with GLM-4's changes, built from a model's config: one place, used by the
model replica (:class:`~serve_app.engine.server.EngineServer`) and by the benchmarks and tests
that measure or drive an engine without Serve. Runs in each model replica.

Three steps, each what vLLM's own API server does, in its order:

1. :func:`engine_config`: the engine arguments of the serve config resolved by vLLM
   (``AsyncEngineArgs.create_engine_config``), GLM-4's front-end defaults added, and a half
   precision GLM-4 cannot run in refused before anything loads;
2. :func:`build_engine`: vLLM's ``AsyncLLM``, generating with vLLM's engine core or, with
   ``simulated_engine`` in the config, with :mod:`serve_app.simulated_engine`;
3. :func:`serving_state`: vLLM's OpenAI serving objects (``init_app_state``), finished for
   GLM-4 (:mod:`serve_app.glm4.serving`: template, stop tokens, tool calls) and held to the
   context (:mod:`serve_app.engine.context_limit`).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any

from serve_app import vllm_internals
from serve_app.config import ModelConfig, split_engine_args
from serve_app.engine.context_limit import enforce_context_limit
from serve_app.simulated_engine import FINGERPRINT as SIMULATED_FINGERPRINT


@dataclass(frozen=True)
class EngineConfig:
    """A model's engine as vLLM resolved it, with the front-end arguments its serving objects read."""

    model: ModelConfig
    engine_args: Any  # vllm.engine.arg_utils.AsyncEngineArgs
    vllm_config: Any  # vllm.config.VllmConfig
    frontend_kwargs: dict[str, Any]


def engine_config(model: ModelConfig) -> EngineConfig:
    """``model``'s engine arguments resolved as vLLM's API server resolves them; a half precision refused."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from serve_app.glm4 import serving as glm4_serving
    from serve_app.glm4.format import check_dtype

    engine_kwargs, frontend_kwargs = split_engine_args(model.engine_args)
    frontend_kwargs = glm4_serving.frontend_defaults() | frontend_kwargs
    if model.simulated_engine is not None:  # every response says it is simulated
        frontend_kwargs |= {"fingerprint_mode": "custom", "fingerprint_value": SIMULATED_FINGERPRINT}
    engine_args = AsyncEngineArgs(**engine_kwargs, served_model_name=[model.name])
    with vllm_internals.process_logging_preserved():  # (vLLM configures its logging here too)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    # "auto" may resolve to float16 on GPUs without bfloat16; refuse before loading.
    check_dtype(vllm_config.model_config.dtype)
    return EngineConfig(model, engine_args, vllm_config, frontend_kwargs)


def build_engine(config: EngineConfig, stat_loggers: list[Any] | None = None) -> Any:
    """vLLM's ``AsyncLLM`` for ``config``: on vLLM's engine core, or on the simulated one.

    ``stat_loggers``: vLLM stat-logger classes, called after every engine step (the replica's
    metrics and its engine watch).
    """
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from serve_app.simulated_engine.core import simulated_async_llm

    options = dict(
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=config.engine_args.enable_log_requests,
        stat_loggers=stat_loggers,
        disable_log_stats=config.engine_args.disable_log_stats,
    )
    simulated = config.model.simulated_engine
    with vllm_internals.process_logging_preserved():  # (vLLM configures logging as it builds one)
        if simulated is None:
            return AsyncLLM.from_vllm_config(vllm_config=config.vllm_config, **options)
        return simulated_async_llm(config.vllm_config, simulated, **options)


async def serving_state(engine: Any, config: EngineConfig, logprobs_prompt_tokens: int | None = None) -> Any:
    """vLLM's OpenAI serving objects over ``engine`` (a Starlette ``State``, as vLLM's API server
    keeps them), finished for GLM-4 and held to the context; ``state.stop_token_ids`` lists the
    tokens every answer stops on.

    ``logprobs_prompt_tokens``: the longest prompt whose log-probabilities are computed
    (``ingress.prompt_logprobs``), in tokens.
    """
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    from serve_app.glm4 import serving as glm4_serving

    # vLLM's serving objects read a flat namespace of front-end and engine arguments, as its
    # CLI parser produces: nested configs given as mappings in the serve config are taken as
    # the engine resolved them.
    vllm_config = config.vllm_config
    engine_values = {
        name: getattr(vllm_config, name) if isinstance(value, dict) and hasattr(vllm_config, name) else value
        for name, value in vars(config.engine_args).items()
    }
    frontend_args = FrontendArgs(**config.frontend_kwargs)
    args = argparse.Namespace(**(vars(frontend_args) | engine_values))
    state = State()
    await init_app_state(engine, state, args, supported_tasks=await engine.get_supported_tasks())
    state.stop_token_ids = glm4_serving.configure(state, engine)
    await asyncio.to_thread(vllm_internals.warm_structured_output_validation, engine.get_tokenizer())
    enforce_context_limit(state.openai_serving_chat, vllm_internals.CHAT_RENDER_STEP, logprobs_prompt_tokens)
    enforce_context_limit(
        state.openai_serving_completion, vllm_internals.COMPLETION_RENDER_STEP, logprobs_prompt_tokens
    )
    enforce_context_limit(state.openai_serving_responses, vllm_internals.RESPONSES_RENDER_STEP)
    return state
