"""Application configuration: the validated shape of a serve config's ``args``.

``serve run deploy/config.yaml`` hands the ``args`` mapping of the application to
:func:`serve_app.app.build_app`, which validates it here before anything starts.
A mistake (an unknown engine argument, a negative replica count, two models with
one name) fails at start with a message naming the field, not minutes later
inside a replica. Deployment options are checked with Ray Serve's own
``DeploymentSchema`` and engine arguments against vLLM's own argument classes, so
both keep vLLM's and Ray's names and meanings.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.glm4 import sizing
from serve_app.glm4.format import check_dtype
from serve_app.structured_outputs import with_grammar_backend
from serve_app.vllm_internals import engine_argument_names, kv_cache_dtypes, quantization_methods

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


# Requests a model replica takes past its generation limit (health, model list).
DIRECT_REQUESTS_HEADROOM = 64
# Keys of the relay path (an ingress deployment relaying answers), retired: a config that sets one is refused.
RETIRED_INGRESS_KEYS = ("direct_streaming", "deployment")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@functools.cache
def vllm_argument_names() -> tuple[frozenset[str], frozenset[str]]:
    """Names of vLLM's engine arguments and of its OpenAI front-end arguments (read from vLLM's
    source, not imported: the application's build stays light, serve_app.vllm_internals)."""
    return engine_argument_names()


def split_engine_args(engine_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``engine_args`` into (engine, front-end) keyword arguments.

    vLLM's own CLI mixes both kinds (``--max-model-len`` and ``--chat-template``);
    the config does too, and this is the one place that tells them apart.
    """
    engine_names, frontend_names = vllm_argument_names()
    engine = {k: v for k, v in engine_args.items() if k in engine_names}
    frontend = {k: v for k, v in engine_args.items() if k in frontend_names and k not in engine}
    return engine, frontend


_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def check_quantisation(engine_args: dict[str, Any]) -> None:
    """``quantization`` and ``kv_cache_dtype`` are values vLLM knows (its own lists), named at
    config time rather than when a replica builds its engine; a float16 KV cache is refused as
    float16 activations are (GLM-4's values overflow it). Whether the GPU runs the method
    (FP8 needs compute capability 8.9 for its fast path) vLLM checks as it builds its config,
    before any weight loads."""
    methods, cache_dtypes = quantization_methods(), kv_cache_dtypes()
    method = engine_args.get("quantization")
    if method is not None and method not in methods:
        raise ValueError(f"quantization {method!r} is not one of vLLM's methods ({', '.join(methods)})")
    cache_dtype = engine_args.get("kv_cache_dtype", "auto")
    if cache_dtype not in cache_dtypes:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not one of vLLM's ({', '.join(cache_dtypes)})")
    try:
        check_dtype(cache_dtype)
    except ValueError as refused:
        raise ValueError(f"kv_cache_dtype: {refused}") from None


def check_remote_code_is_pinned(engine_args: dict[str, Any]) -> None:
    """With ``trust_remote_code``, the checkpoint's own code runs in every replica: it must come
    from a commit, not a branch or tag (or the default branch), which can change under a running
    deployment so that the next replica to start runs other code. A local directory is exempt:
    what was deployed is what runs."""
    if not engine_args.get("trust_remote_code") or Path(str(engine_args["model"])).is_dir():
        return
    # revision is required; code_revision and tokenizer_revision default to it.
    pins = {"revision": engine_args.get("revision")} | {
        name: engine_args[name] for name in ("code_revision", "tokenizer_revision") if engine_args.get(name) is not None
    }
    loose = [name for name, value in pins.items() if not _COMMIT_RE.match(str(value))]
    if loose:
        raise ValueError(
            "trust_remote_code runs the checkpoint's code in every replica: pin "
            + ", ".join(loose)
            + " to a commit (40 hexadecimal characters), not a branch or tag"
        )


# vLLM's FP8 methods that need FP8 arithmetic: on a GPU without it, vLLM's other FP8 methods run
# as FP8 weights computed in bfloat16 (Marlin), this one fails once its weights are loaded.
FP8_COMPUTE_ONLY = frozenset({"fp8_per_channel"})


def check_fits_accelerator(engine_args: dict[str, Any], accelerator_type: str) -> None:
    """The GPU a replica asks Ray for (``ray_actor_options.accelerator_type``) can run GLM-4-9B as
    configured: it computes in bfloat16 (and in FP8 where the method needs it), and its memory
    holds the weights and the KV cache of one ``max_model_len`` sequence at
    ``gpu_memory_utilization``. Sizes are GLM-4-9B's
    (:mod:`serve_app.glm4.sizing`); activations are not counted, so a config refused here cannot
    start, and one passed may still be refused by vLLM's memory profile as the replica starts.
    A type :data:`serve_app.accelerators.ACCELERATORS` does not list is not checked."""
    from serve_app.accelerators import ACCELERATORS

    gpu = ACCELERATORS.get(accelerator_type)
    if gpu is None:
        return
    if not gpu.bfloat16:
        major, minor = gpu.compute_capability
        raise ValueError(
            f"accelerator_type {accelerator_type} (compute capability {major}.{minor}) has no bfloat16, which "
            "GLM-4 computes in (float16 overflows), FP8 and 4-bit weights included: it needs 8.0 (Ampere) or later"
        )
    quantization = engine_args.get("quantization")
    if quantization in FP8_COMPUTE_ONLY and not gpu.fp8:
        raise ValueError(
            f"quantization {quantization} computes in FP8, which accelerator_type {accelerator_type} has no "
            "tensor cores for (compute capability 8.9 or later: L4, L40S, H100, H200); fp8_per_tensor runs there "
            "as FP8 weights with bfloat16 arithmetic (vLLM's Marlin kernel)"
        )
    kv_dtype = engine_args.get("kv_cache_dtype") or "auto"
    if "max_model_len" not in engine_args or kv_dtype not in sizing.KV_ELEMENT_BYTES:
        return
    weights = sizing.least_weights_gb(quantization)
    room = sizing.kv_room_gb(gpu.memory_gb, float(engine_args.get("gpu_memory_utilization", 0.9)), weights)
    needed = int(engine_args["max_model_len"]) * sizing.kv_bytes_per_token(kv_dtype) / 1e9
    if room < needed:
        fits = max(0, int(room * 1e9 / sizing.kv_bytes_per_token(kv_dtype)))
        raise ValueError(
            f"on {accelerator_type} ({gpu.memory_gb:g} GB) at gpu_memory_utilization "
            f"{engine_args.get('gpu_memory_utilization', 0.9)}, {weights:.1f} GB of weights "
            f"(quantization {quantization}) leave {max(room, 0):.1f} GB for the KV cache, before activations; one "
            f"max_model_len {engine_args['max_model_len']} sequence needs {needed:.1f} GB (kv_cache_dtype "
            f"{kv_dtype}): lower max_model_len below {fits}, or quantise the weights or the KV cache"
        )


def validate_deployment_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check Ray Serve deployment options with Ray's own models; return them unchanged."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema

    if "name" in options:
        raise ValueError("'name' is set by the application; remove it")
    try:
        DeploymentSchema(name="deployment", **options)
        # The schema keeps autoscaling_config as a plain mapping; check its fields too.
        if isinstance(options.get("autoscaling_config"), dict):
            AutoscalingConfig(**options["autoscaling_config"])
    except ValidationError as exc:
        where = "autoscaling_config." if exc.title == "AutoscalingConfig" else ""
        problems = "; ".join(where + ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in exc.errors())
        raise ValueError(problems) from None
    return options


class StreamBatchingConfig(_Strict):
    """How many tokens each streamed chunk carries, by how busy the replica's engine is.

    Every chunk crosses two hops (model replica to ingress to proxy), each a message
    costing CPU that the engine needs. A stream that starts while the engine holds
    ``held`` requests gets ``1 + held // requests_per_token`` tokens per chunk, at most
    ``max_tokens_per_chunk``: token by token when the engine is nearly idle, fewer
    and larger messages when it is busy and each stream's tokens come slowly anyway.
    It sets vLLM's per-request ``stream_interval``: a stream's first and last chunks
    are always sent at once, and a client that sets ``stream_interval`` keeps its own.
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


class PrefixRoutingConfig(_Strict):
    """Route each request to the replica whose prefix cache holds its prompt's start, load first.

    The rule and its defaults: docs/configuration.md ("Prefix-aware routing") and
    :mod:`serve_app.prefix_routing.table`. Off: Serve's default router (power of two
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

    def router_config(self, model: str, chat_template: str | None) -> dict[str, Any]:
        """The deployment's ``request_router_config``: this app's router and its settings."""
        return {
            "request_router_class": "serve_app.prefix_routing.router:PrefixAffinityRouter",
            "request_router_kwargs": {
                "model": model,
                "chat_template": chat_template,
                "max_load_gap": self.max_load_gap,
                "block_chars": self.block_chars,
                "max_blocks": self.max_blocks,
            },
        }


class SimulatedEngineConfig(_Strict):
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


class ModelConfig(_Strict):
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
        ingress answers that larger one with a 400 instead.
        """
        override = self.engine_args.get("override_generation_config") or {}
        value = override.get("max_new_tokens")
        return value if isinstance(value, int) else None

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        if not _NAME_RE.match(value):
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

    def resolved_deployment(self, longest_answer_s: float | None = None) -> dict[str, Any]:
        """Deployment options with the defaults this application relies on.

        ``max_ongoing_requests`` defaults to ``max_num_seqs``: a replica then
        runs as many requests as its engine batches at once (the autoscaler's unit).
        ``graceful_shutdown_timeout_s`` defaults to the longest answer allowed, so
        a replica being removed finishes every stream it has.
        """
        options = dict(self.deployment)
        if "max_ongoing_requests" not in options:
            options["max_ongoing_requests"] = self.engine_args["max_num_seqs"]
        if longest_answer_s is not None and "graceful_shutdown_timeout_s" not in options:
            options["graceful_shutdown_timeout_s"] = longest_answer_s
        if self.prefix_routing.enabled:
            options["request_router_config"] = self.prefix_routing.router_config(
                self.name, self.engine_args.get("chat_template")
            )
        return options

    def generation_limit(self) -> int | None:
        """Most generation requests one replica holds: what it runs at once
        and what may wait for it (None: unbounded, as Serve's max_queued_requests of -1)."""
        options = self.resolved_deployment()
        queued = options.get("max_queued_requests", -1)
        return None if queued < 0 else options["max_ongoing_requests"] + queued

    def runs_at_once(self) -> int:
        """Requests one replica runs at once: its ``max_ongoing_requests`` (by default ``max_num_seqs``)."""
        return int(self.resolved_deployment()["max_ongoing_requests"])

    def with_priority_scheduling(self) -> ModelConfig:
        """This model with vLLM's priority scheduling, which :class:`~serve_app.ingress.capacity.FairShare` uses."""
        return self.model_copy(update={"engine_args": self.engine_args | {"scheduling_policy": "priority"}})

    def resolved_direct_deployment(self, longest_answer_s: float | None = None) -> dict[str, Any]:
        """Deployment options of the model replicas, which answer clients themselves.

        Serve's per-replica limit would hold ``/health`` and ``/v1/models`` behind
        generation, so it is raised by :data:`DIRECT_REQUESTS_HEADROOM` past the
        :meth:`generation_limit`, which the replica's front door enforces itself
        (:mod:`serve_app.ingress.capacity`); the engine queues past its batch.
        """
        options = self.resolved_deployment(longest_answer_s)
        limit = self.generation_limit()
        options["max_ongoing_requests"] = (limit or options["max_ongoing_requests"]) + DIRECT_REQUESTS_HEADROOM
        options.pop("max_queued_requests", None)
        return options


class APIKeysConfig(_Strict):
    """Where the ingress reads its API keys; set exactly one source.

    One key per line; blank lines and ``#`` comments are ignored (see
    :func:`serve_app.ingress.auth.parse_keys`). A source that holds no key, or a malformed
    one, stops the ingress from starting: keys that are configured but missing
    never mean an open server.
    """

    env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding the keys (a Kubernetes Secret fills it).",
    )
    file: str | None = Field(
        default=None,
        min_length=1,
        description="Path of a file holding the keys (a mounted Secret); re-read when it changes.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> APIKeysConfig:
        if (self.env is None) == (self.file is None):
            raise ValueError("set exactly one of 'env' and 'file'")
        return self


class CORSConfig(_Strict):
    """Cross-origin requests from browsers; without this section none are allowed."""

    allow_origins: list[str] = Field(
        min_length=1, description="Origins allowed to call the API from a browser, e.g. https://chat.example.com."
    )
    allow_headers: list[str] = Field(
        default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Timeout"],
        description="Request headers a browser may send cross-origin.",
    )
    max_age_s: int = Field(default=600, ge=0, description="How long a browser may cache a preflight answer.")


class RateLimitsConfig(_Strict):
    """Limits every API key gets, enforced together by all model replicas; set at least one.

    Each is a token bucket that holds a minute's worth and refills continuously, so
    a key may burst up to its limit and then sustain it. Tokens are prompt plus
    completion tokens, counted when an answer ends; a request is admitted while its
    key's token bucket is not empty.
    """

    requests_per_minute: int | None = Field(default=None, gt=0, description="Requests each key may send per minute.")
    tokens_per_minute: int | None = Field(
        default=None, gt=0, description="Prompt plus completion tokens each key may use per minute."
    )
    max_concurrent_requests: int | None = Field(
        default=None,
        gt=0,
        description="Generation requests each key may have under way at once, across all replicas; past it, "
        "429 with Retry-After. If the limiter cannot be reached, each replica holds a key to this many on its "
        "own (requests and tokens per minute then go unchecked).",
    )
    deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Serve options of the one-replica deployment that keeps the counts (e.g. ray_actor_options).",
    )

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimitsConfig:
        if self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrent_requests is None:
            raise ValueError("set requests_per_minute, tokens_per_minute, max_concurrent_requests or several")
        return self

    @field_validator("deployment")
    @classmethod
    def _deployment_is_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        value = validate_deployment_options(value)
        for option in ("num_replicas", "autoscaling_config"):
            if option in value:
                raise ValueError(f"{option} cannot be set: one replica keeps every key's counts")
        return value


class PromptLogprobsConfig(_Strict):
    """How far a request may ask for prompt_logprobs (off unless set)."""

    max_logprobs: int = Field(
        ge=0, le=20, description="Most prompt_logprobs one request may ask for (vLLM's -1, the vocabulary, never)."
    )
    max_prompt_tokens: int = Field(
        default=2048,
        ge=1,
        description="Longest prompt, in tokens, whose log-probabilities are computed; a longer one is a 400. "
        "Checked on characters before tokenizing (at ingress.max_prompt_chars_per_token), then on tokens.",
    )


class IngressConfig(_Strict):
    """The front door every model replica runs for its clients (HTTP and gRPC): the limits it enforces."""

    rate_limits: RateLimitsConfig | None = Field(
        default=None, description="Per-API-key limits (429 with Retry-After past them); needs api_keys."
    )

    cors: CORSConfig | None = Field(default=None, description="Off unless set: no CORS headers are sent.")

    api_keys: APIKeysConfig | None = Field(
        default=None,
        description="When set, every /v1/* request needs 'Authorization: Bearer <key>'; /health stays open.",
    )

    max_request_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="Larger request bodies get 413 before they are parsed.",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest a client may take to send its request body; past it, 408 (slow uploads).",
    )
    max_n: int = Field(
        default=8,
        ge=1,
        description="Most choices (n) one request may ask for: each is its own sequence in the engine's "
        "batch, so one request cannot take a replica's whole batch; more is a 400.",
    )
    max_sequences_per_request: int = Field(
        default=8,
        ge=1,
        description="Most sequences one request may start in the engine: its prompts (a /v1/completions "
        "prompt may be a list) times its choices (n). Serve's concurrency limits and the autoscaler count "
        "a request as one, so this bounds what one request can take of a replica's batch; more is a 400 "
        "naming prompt or n. At most every model's engine_args.max_num_seqs.",
    )
    max_prompt_chars_per_token: int = Field(
        default=16,
        ge=1,
        description="A prompt is refused (400) before any tokenizer runs when its text has more characters "
        "than the model's max_model_len times this: it could not fit the context unless its tokens averaged "
        "more characters than that (GLM-4's average about 4 in English, fewer in Chinese or code). A prompt "
        "of token ids is held to max_model_len ids.",
    )
    allow_beam_search: bool = Field(
        default=False,
        description="Whether a request may set vLLM's use_beam_search: beam search keeps n beams per "
        "request alive through the whole answer; off, it is a 400.",
    )
    prompt_logprobs: PromptLogprobsConfig | None = Field(
        default=None,
        description="Unset (every shipped config): prompt_logprobs, and echo with log-probabilities (which "
        "asks vLLM for them), are a 400. Computing them takes a vocabulary-wide distribution for every "
        "prompt token, which on long prompts can run the engine out of memory.",
    )
    max_logprobs_per_request: int = Field(
        default=200_000,
        ge=1,
        description="Most log-probabilities one answer may carry: its sequences (prompts times n) times "
        "max_tokens (or, unset, the model's ceiling) times each token's own plus its top_logprobs (or "
        "logprob_token_ids). The default fits one 8192-token answer at top_logprobs 20; more is a 400 "
        "naming the parameter, since a unary answer holds them all in memory and in one JSON body.",
    )
    max_grammar_chars: int = Field(
        default=32_768,
        ge=1,
        description="Most characters of JSON a request's structured-output specs may take: response_format, "
        "structured_outputs, and tools when tool_choice forces a call. vLLM builds the grammar on the "
        "replica's event loop, in time that grows with the spec; more is a 400 naming the parameter.",
    )
    max_grammar_build_s: float = Field(
        default=0.5,
        gt=0,
        description="Most CPU time a request's grammar may take to build. A spec's size does not bound that work "
        '({"type": "array", "maxItems": 1000000000} is 41 characters; llguidance builds its items one by one, '
        "a million in 4 s on a 2-core VM, in time and memory that grow with them), and vLLM builds it where "
        "it cannot be stopped: on the "
        "replica's event loop, then in the engine. So the ingress builds it first as both will, in its "
        "checker process, which is killed at this much CPU time (or ten times it in wall time, if it gets no "
        "CPU) and started again; the request gets a 400 grammar_too_costly naming the parameter. CPU time, not "
        "wall time, so that a busy machine does not refuse ordinary specs. Specs at max_grammar_chars build "
        "there in at most 0.14 s on a 2-core VM (docs/performance.md).",
    )
    max_token_list_entries: int = Field(
        default=1024,
        ge=1,
        description="Most entries in each of a request's lists of tokens: logit_bias, allowed_token_ids and "
        "stop_token_ids (vLLM's). The engine builds each into tensors or sets for every sequence; more is a "
        "400 naming the list.",
    )
    max_bad_words: int = Field(
        default=256,
        ge=0,
        description="Most entries in a request's bad_words (vLLM's). The engine checks each word in Python at "
        "every step of each of the request's sequences, in the loop that steps the whole batch; more is a 400.",
    )
    fair_share: bool = Field(
        default=True,
        description="Each API key's requests are counted where they wait: waiting requests are served by "
        "how many their key holds there (vLLM's priority scheduling, set on the engine), and the last places "
        "(one batch's worth: at most half of max_queued_requests) go only to keys holding fewer than their "
        "part of them; a key refused for that gets 429 fair_share_exceeded. So one key's flood neither "
        "delays another key's request past about one slot's turnover nor gets it refused "
        '(docs/api-behaviour.md, "Fair share between API keys"). Needs api_keys.',
    )
    health_max_age_s: float = Field(
        default=30.0,
        gt=0,
        description="GET /health answers from Serve's status, read in the background every second; "
        "if the Serve controller has not answered for this long, /health answers 503.",
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Longest a request may take, first byte to last; past it, it is cancelled (504 or an error event).",
    )
    first_token_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Longest a stream may wait for its first chunk (queueing and prefill); past it, 504.",
    )
    unavailable_retry_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a request that no replica has started is sent again while replicas answer "
        "'unavailable' (an engine died, a replica is going away); then 503 with Retry-After.",
    )
    log_requests: bool = Field(
        default=True,
        description="One JSON line per generation request in the log of the model replica that answered it "
        "(id, model, status, tokens, time to first token, duration).",
    )
    log_content: bool = Field(
        default=False,
        description="Also put each request's messages or prompt, and its completion, in that line. "
        "They are users' data: off unless you need them.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_relay_keys(cls, data: Any) -> Any:
        """Keys of the relay path, retired (docs/architecture.md, record 18): named, not 'extra inputs'."""
        if isinstance(data, dict):
            for key in RETIRED_INGRESS_KEYS:
                if key in data:
                    raise ValueError(
                        f"ingress.{key} is no longer read: answers always stream from the model replica, and "
                        "the ingress deployment it configured is gone (docs/architecture.md, record 18); remove it"
                    )
        return data

    @property
    def applies_fair_share(self) -> bool:
        """Whether places are shared fairly between API keys: fair_share, with keys to tell tenants apart."""
        return self.fair_share and self.api_keys is not None


class AppConfig(_Strict):
    """The whole application: the models it serves and its ingress."""

    models: list[ModelConfig] = Field(
        min_length=1, description="The models served, at least one; each is its own deployment, model-<name>."
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @field_validator("models")
    @classmethod
    def _names_are_unique(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        return models

    @model_validator(mode="after")
    def _one_model(self) -> AppConfig:
        if len(self.models) != 1:
            raise ValueError(
                f"models lists {len(self.models)}: an application serves exactly one model (its replicas "
                "answer clients themselves); give each model its own application"
            )
        return self

    @model_validator(mode="after")
    def _a_request_fits_in_a_batch(self) -> AppConfig:
        limit = self.ingress.max_sequences_per_request
        for i, model in enumerate(self.models):
            batch = model.engine_args.get("max_num_seqs")
            if isinstance(batch, int) and limit > batch:
                raise ValueError(
                    f"ingress.max_sequences_per_request ({limit}) is above models.{i}.engine_args.max_num_seqs "
                    f"({batch}): one request could ask for more sequences than a replica runs at once"
                )
        return self

    @model_validator(mode="after")
    def _fair_share_schedules_by_priority(self) -> AppConfig:
        if not self.ingress.applies_fair_share:
            return self
        for i, model in enumerate(self.models):
            policy = model.engine_args.get("scheduling_policy", "priority")
            if policy != "priority":
                raise ValueError(
                    f"models.{i}.engine_args.scheduling_policy is {policy!r}: ingress.fair_share schedules "
                    "waiting requests by priority; remove it, or set ingress.fair_share: false"
                )
        return self

    @model_validator(mode="after")
    def _limits_have_keys(self) -> AppConfig:
        if self.ingress.rate_limits is not None and self.ingress.api_keys is None:
            raise ValueError("ingress.rate_limits are per API key: set ingress.api_keys too")
        return self

    @model_validator(mode="after")
    def _stalls_are_caught_before_requests_time_out(self) -> AppConfig:
        limit = self.ingress.request_timeout_s
        for i, model in enumerate(self.models):
            if model.engine_stall_timeout_s >= limit:
                raise ValueError(
                    f"models.{i}.engine_stall_timeout_s ({model.engine_stall_timeout_s:g}) is not below "
                    f"ingress.request_timeout_s ({limit:g}): every request would time out before a hung "
                    "engine is noticed"
                )
        return self

    @model_validator(mode="after")
    def _drain_outlasts_answers(self) -> AppConfig:
        limit = self.ingress.request_timeout_s
        deployments = {f"models.{i}": m.deployment for i, m in enumerate(self.models)}
        for where, options in deployments.items():
            drain = options.get("graceful_shutdown_timeout_s")
            if drain is not None and drain < limit:
                raise ValueError(
                    f"{where}.deployment.graceful_shutdown_timeout_s ({drain:g}) is shorter than "
                    f"ingress.request_timeout_s ({limit:g}): a replica removed by downscaling or a "
                    "config change would cut answers that are still allowed to run"
                )
        return self


class ConfigError(ValueError):
    """The serve config's application arguments are invalid."""


def parse_app_config(args: dict[str, Any]) -> AppConfig:
    """Validate application arguments, raising :class:`ConfigError` that names each bad field."""
    from pydantic import ValidationError

    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(top level)"
            problems.append(f"  args.{where}: {error['msg']}")
        raise ConfigError("invalid application arguments:\n" + "\n".join(problems)) from None
