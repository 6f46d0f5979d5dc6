"""The ``models`` section of a serve config's ``args``: one served model, its engine and its deployment.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import NAME_RE, StrictModel
from serve_app.config.checks import (
    check_fits_accelerator,
    check_quantisation,
    check_remote_code_is_pinned,
    validate_deployment_options,
    vllm_argument_names,
)
from serve_app.config.structured_outputs import with_grammar_backend
from serve_app.glm4 import sizing
from serve_app.glm4.format import check_dtype


class StreamBatchingConfig(StrictModel):
    """How many tokens each streamed chunk carries, by how busy the replica's engine is.

    Every chunk is a write to the client's connection, which HAProxy forwards: CPU of
    the replica's process and of the node that the engine needs. A stream that starts while the engine holds
    ``held`` requests gets ``1 + held // requests_per_token`` tokens per chunk, at most
    ``max_tokens_per_chunk``: token by token when the engine is nearly idle, fewer
    and larger messages when it is busy and each stream's tokens come slowly anyway.
    It sets vLLM's per-request ``stream_interval``: a stream's first and last chunks
    are always sent at once, and a client that sets ``stream_interval`` keeps its own.
    The Responses API's generations get it too (a delta event per chunk).
    """

    requests_per_token: int = Field(
        default=4, gt=0, description="One more token per chunk for each this many requests the engine holds."
    )
    max_tokens_per_chunk: int = Field(
        default=8, ge=1, description="The most tokens a chunk waits for; 1 streams every token on its own."
    )

    def tokens_per_chunk(self, held: int) -> int:
        """Tokens per chunk for a stream starting while the engine holds ``held`` requests."""
        return min(self.max_tokens_per_chunk, 1 + held // self.requests_per_token)


class PrefixRoutingConfig(StrictModel):
    """Route each request to the replica whose prefix cache holds its prompt's start, load first.

    The rule and its defaults: docs/configuration.md ("Prefix-aware routing") and
    :mod:`serve_app.routing.prefix_table`. Off: Serve's default router (power of two
    choices on queue length).
    """

    enabled: bool = Field(default=True, description="Route by prompt prefix; false: Serve's default router.")
    max_load_gap: int = Field(
        default=16,
        ge=0,
        description="The replica holding a prompt's prefix gets the request unless it runs more than this many "
        "requests beyond the least busy replica; then load decides (power of two choices).",
    )
    block_chars: int = Field(
        default=64,
        ge=8,
        description="Characters of rendered prompt per remembered block (about 16 tokens, vLLM's KV block).",
    )
    max_blocks: int = Field(
        default=200_000,
        ge=1,
        description="Blocks the router remembers in each picker replica (least recently used forgotten first).",
    )


class SimulatedEngineConfig(StrictModel):
    """Serve the model from a simulated engine in place of vLLM's engine core.

    Only token generation is replaced: vLLM's ``AsyncLLM`` (input processing,
    detokenizer, stop strings, ``n``, aborts, its metrics), its OpenAI serving
    objects and everything of this app run as with the real engine. Token ids are
    drawn from the configured model's tokenizer with a seeded generator and come out
    on the timing of GLM-4-9B-Chat on one 80 GB H100 with continuous batching, its
    weights and KV cache sized as the model's ``engine_args`` quantise them (bf16 by
    default; see :mod:`serve_app.simulated_engine` and :mod:`serve_app.glm4.sizing`).
    The defaults are estimates from the hardware's published figures, to be replaced
    by figures from a GPU run. For
    measuring the serving layer at GPU speed on a machine without one: its answers
    are noise, and ``/v1/models`` and every ``system_fingerprint`` say ``simulated``.
    """

    load_s: float = Field(
        default=30.0, ge=0, description="Model load time: the replica reports ready this long after it starts."
    )
    seed: int = Field(default=0, description="Seeds the token draws of requests that set no seed of their own.")
    stop_probability: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Chance per token that a request allowed to end early (no ignore_eos, min_tokens "
        "reached) ends with its stop token; 0: every answer runs to max_tokens.",
    )
    gpu_memory_gb: float = Field(default=80.0, gt=0, description="The GPU's memory (H100 80 GB).")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Share of the GPU's memory for weights and KV cache (vLLM's own)."
    )
    weights_gb: float | None = Field(
        default=None,
        gt=0,
        description="Weights; unset: from the model's engine_args.quantization (serve_app.glm4.sizing): "
        "18.8 in bf16, 10.6 in fp8 (the vocabulary matrices stay bf16), 6.8 in AWQ 4-bit.",
    )
    kv_bytes_per_token: int | None = Field(
        default=None,
        gt=0,
        description="KV cache per token; unset: from the model's engine_args.kv_cache_dtype: 2 (K, V) x 40 "
        "layers x 2 KV heads x 128 dims x 2 bytes (40960) in bf16, x 1 byte (20480) in fp8.",
    )
    memory_bandwidth_tb_s: float = Field(
        default=3.35,
        gt=0,
        description="HBM bandwidth (H100 SXM): each decode step reads all the weights and every running sequence's KV.",
    )
    step_launch_ms: float = Field(
        default=1.4,
        ge=0,
        description="Launch and sampling in each engine step, beyond reading the weights (weights_gb at "
        "memory_bandwidth_tb_s: 5.6 ms in bf16, 3.2 ms in fp8).",
    )
    prefill_ms_per_token: float = Field(
        default=0.031,
        ge=0,
        description="Prefill compute per prompt token: 9.4 B params x 2 FLOP at ~600 TFLOP/s achieved.",
    )
    max_num_batched_tokens: int = Field(
        default=8192,
        gt=0,
        description="Tokens one step computes, prefill chunks included (vLLM's default on an H100).",
    )
    kv_block_tokens: int = Field(
        default=16,
        gt=0,
        description="Tokens per KV cache block (vLLM's default on GPUs): with enable_prefix_caching, "
        "the simulated prefix cache keeps and finds whole blocks of prompts.",
    )

    @model_validator(mode="after")
    def _kv_cache_has_room(self) -> SimulatedEngineConfig:
        if sizing.kv_room_gb(self.gpu_memory_gb, self.gpu_memory_utilization, self.resolved_weights_gb()) <= 0:
            raise ValueError("gpu_memory_gb x gpu_memory_utilization leaves no room for the KV cache after weights_gb")
        return self

    def resolved_weights_gb(self) -> float:
        """``weights_gb``, or the bf16 checkpoint's where it was not set and no engine args resolved it."""
        return self.weights_gb if self.weights_gb is not None else sizing.weights_gb()

    def resolved_kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token if self.kv_bytes_per_token is not None else sizing.kv_bytes_per_token()


def sized_for(simulated: dict[str, Any], engine_args: dict[str, Any]) -> dict[str, Any]:
    """Simulated engine settings with the weights' and KV cache's sizes vLLM's arguments give
    (``quantization``, ``kv_cache_dtype``: :mod:`serve_app.glm4.sizing`), where they set none."""
    sized = dict(simulated)
    if sized.get("weights_gb") is None:
        sized["weights_gb"] = sizing.weights_gb(engine_args.get("quantization"))
    if sized.get("kv_bytes_per_token") is None:
        sized["kv_bytes_per_token"] = sizing.kv_bytes_per_token(engine_args.get("kv_cache_dtype") or "auto")
    return sized


class ModelConfig(StrictModel):
    """One served model: its public name, vLLM engine arguments and Serve deployment options."""

    name: str = Field(description="The `model` value clients send, e.g. glm-4-9b-chat.")
    engine_args: dict[str, Any] = Field(
        description="vLLM engine and front-end arguments, with vLLM's own names (model, max_model_len, ...)."
    )
    deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray Serve deployment options (autoscaling_config, max_ongoing_requests, ...); "
        "max_ongoing_requests defaults to engine_args.max_num_seqs, graceful_shutdown_timeout_s to "
        "ingress.request_timeout_s.",
    )
    stream_batching: StreamBatchingConfig = Field(default_factory=StreamBatchingConfig)
    prefix_routing: PrefixRoutingConfig = Field(default_factory=PrefixRoutingConfig)
    simulated_engine: SimulatedEngineConfig | None = Field(
        default=None,
        description="Serve from a simulated engine at GPU speed instead of vLLM's (benchmarks on a machine "
        "without a GPU); not set: the real engine.",
    )
    engine_stall_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="An engine that holds requests and has produced no output for this long is taken "
        "as hung: its requests get errors and the replica is replaced. Several times the slowest "
        "engine step (a 128K-token prefill takes seconds on a GPU); below ingress.request_timeout_s.",
    )

    @property
    def max_output_tokens(self) -> int | None:
        """The ceiling on one answer's tokens: vLLM's ``override_generation_config.max_new_tokens``.

        vLLM gives a request without ``max_tokens`` this or what the context leaves,
        whichever is smaller, and silently lowers a larger ``max_tokens`` to it; the
        front door answers that larger one with a 400 instead.
        """
        override = self.engine_args.get("override_generation_config") or {}
        value = override.get("max_new_tokens")
        return value if isinstance(value, int) else None

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError(
                "must start with a letter or digit and hold only letters, digits and . _ : / - (at most 128)"
            )
        return value

    @field_validator("engine_args")
    @classmethod
    def _engine_args_are_vllm_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value.get("model"):
            raise ValueError("'model' (a Hugging Face id or a local path) is required")
        engine_names, frontend_names = vllm_argument_names()
        unknown = sorted(set(value) - engine_names - frontend_names)
        if unknown:
            raise ValueError(f"unknown vLLM argument(s): {', '.join(unknown)}")
        if "served_model_name" in value:
            raise ValueError("'served_model_name' is taken from the model's 'name'; remove it")
        check_dtype(value.get("dtype", "auto"))
        check_quantisation(value)
        check_remote_code_is_pinned(value)
        return with_grammar_backend(value)

    @field_validator("deployment")
    @classmethod
    def _deployment_is_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        return validate_deployment_options(value)

    @model_validator(mode="before")
    @classmethod
    def _simulated_engine_is_sized(cls, data: Any) -> Any:
        """The simulated engine's weights and KV cache take the sizes the engine's arguments give, where unset."""
        simulated, engine_args = (
            (data.get("simulated_engine"), data.get("engine_args")) if isinstance(data, dict) else (None, None)
        )
        if isinstance(simulated, SimulatedEngineConfig):
            simulated = simulated.model_dump(exclude_defaults=True)
        if isinstance(simulated, dict) and isinstance(engine_args, dict):
            data = data | {"simulated_engine": sized_for(simulated, engine_args)}
        return data

    @model_validator(mode="after")
    def _fits_its_gpu(self) -> ModelConfig:
        """One max_model_len sequence fits beside the weights, on the GPU Ray is asked for or the
        simulated one (whose sizes are resolved from the same engine arguments)."""
        accelerator_type = (self.deployment.get("ray_actor_options") or {}).get("accelerator_type")
        if accelerator_type is not None:
            check_fits_accelerator(self.engine_args, accelerator_type)
        simulated, max_model_len = self.simulated_engine, self.engine_args.get("max_model_len")
        if simulated is not None and max_model_len is not None:
            room = sizing.kv_room_gb(
                simulated.gpu_memory_gb, simulated.gpu_memory_utilization, simulated.resolved_weights_gb()
            )
            needed = int(max_model_len) * simulated.resolved_kv_bytes_per_token() / 1e9
            if room < needed:
                raise ValueError(
                    f"simulated_engine: {room:.1f} GB of KV cache after the weights cannot hold one "
                    f"max_model_len {max_model_len} sequence ({needed:.1f} GB)"
                )
        return self

    @model_validator(mode="after")
    def _one_request_router(self) -> ModelConfig:
        if self.prefix_routing.enabled and "request_router_config" in self.deployment:
            raise ValueError(
                "deployment.request_router_config replaces prefix routing: set prefix_routing.enabled: false with it"
            )
        return self

    @model_validator(mode="after")
    def _concurrency_is_explicit(self) -> ModelConfig:
        # vLLM's default max_num_seqs depends on the hardware, so a replica's
        # concurrency limit cannot be matched to it without knowing it.
        if "max_num_seqs" not in self.engine_args and "max_ongoing_requests" not in self.deployment:
            raise ValueError("set engine_args.max_num_seqs (deployment.max_ongoing_requests defaults to it)")
        return self

    @property
    def deployment_name(self) -> str:
        """Serve deployment name: one deployment per model, named after it."""
        return "model-" + re.sub(r"[^A-Za-z0-9_-]", "_", self.name)

    def generation_limit(self) -> int | None:
        """Most generation requests one replica holds: what it runs at once
        and what may wait for it (None: unbounded, as Serve's max_queued_requests of -1)."""
        queued = self.deployment.get("max_queued_requests", -1)
        return None if queued < 0 else self.runs_at_once() + queued

    def runs_at_once(self) -> int:
        """Requests one replica runs at once: its ``max_ongoing_requests`` (by default ``max_num_seqs``)."""
        return int(self.deployment.get("max_ongoing_requests") or self.engine_args["max_num_seqs"])

    def with_priority_scheduling(self) -> ModelConfig:
        """This model with vLLM's priority scheduling, which fair share uses
        (:class:`~serve_app.front_door.admission.capacity.FairShare`)."""
        return self.model_copy(update={"engine_args": self.engine_args | {"scheduling_policy": "priority"}})
