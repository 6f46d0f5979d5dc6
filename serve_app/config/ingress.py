"""The ``ingress`` section of a serve config's ``args``: what every model replica's front door holds requests to.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import StrictModel
from serve_app.config.checks import validate_deployment_options
from serve_app.config.responses_store import ResponsesStoreConfig

# Keys of the relay path (an ingress deployment relaying answers), retired: a config that sets one is refused.
RETIRED_INGRESS_KEYS = ("direct_streaming", "deployment")


class APIKeysConfig(StrictModel):
    """Where the ingress reads its API keys; set exactly one source.

    One key per line; blank lines and ``#`` comments are ignored (see
    :func:`serve_app.front_door.admission.auth.parse_keys`). A source that holds no key, or a malformed
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


class CORSConfig(StrictModel):
    """Cross-origin requests from browsers; without this section none are allowed."""

    allow_origins: list[str] = Field(
        min_length=1, description="Origins allowed to call the API from a browser, e.g. https://chat.example.com."
    )
    allow_headers: list[str] = Field(
        default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Timeout"],
        description="Request headers a browser may send cross-origin.",
    )
    max_age_s: int = Field(default=600, ge=0, description="How long a browser may cache a preflight answer.")


class RateLimitsConfig(StrictModel):
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
        description="Serve options of the RateLimiter deployment that keeps the counts (num_replicas, default "
        "2; ray_actor_options). Each API key's counts live in one of its replicas, picked by hashing the key "
        "(Ray's ConsistentHashRouter); when that replica goes, the key's counts start afresh in the next one.",
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
        if "autoscaling_config" in value:
            raise ValueError("autoscaling_config cannot be set: each replica keeps its keys' counts, set num_replicas")
        return value


class PromptLogprobsConfig(StrictModel):
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


class OpenCallsConfig(StrictModel):
    """Calls that stay open without generating: gRPC Stream and Resume calls, and HTTP GETs (and background
    POSTs with stream) that follow an answer's events. Each holds one place of these for as long as it is
    open, apart from generation's places: an idle call never takes a place from generation or /health."""

    max_per_replica: int = Field(
        default=256,
        ge=1,
        description="Open calls one model replica holds; past it, 429 open_call_limit (gRPC "
        "RESOURCE_EXHAUSTED). Serve's max_ongoing_requests of the replica is raised by as much.",
    )
    max_per_key: int = Field(
        default=32,
        ge=1,
        description="Open calls one API key (or, without keys, all clients together) holds on one replica; "
        "past it, 429 open_call_limit.",
    )


class GRPCStreamConfig(StrictModel):
    """Bounds of one multiplexed gRPC call (``glm4serve.v1.Generation/Stream``), per call."""

    max_requests_at_once: int = Field(
        default=64,
        gt=0,
        description="Requests one Stream call runs at once; one past it gets RESOURCE_EXHAUSTED for its id alone.",
    )
    max_buffered_responses: int = Field(
        default=256,
        gt=0,
        description="Responses one Stream call holds for a client that reads slower than they come; past it, its "
        "requests wait to write (and the call stops reading new ones) until the client reads.",
    )
    idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A Stream call with no request running and no message from its client for this long is "
        "ended (status UNAVAILABLE, details naming the idle time): open a new call for more requests.",
    )


class IngressConfig(StrictModel):
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
        "there in at most 0.14 s on a 2-core VM (docs/performance-history.md).",
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
    prefix_cache_per_key: bool = Field(
        default=True,
        description="Each API key's prompts are cached apart in the engines' prefix cache (vLLM's cache_salt, "
        "made from the key's id and any cache_salt the request brings), and prefix-aware routing keeps keys "
        "apart the same way: no key's request can hit, or time, what another key's prompts left cached, and "
        "the cached_tokens a key is told of come from its own prompts. Turn off where the keys trust each "
        "other (a system prompt they share is then computed once for all). Needs api_keys.",
    )
    health_max_age_s: float = Field(
        default=30.0,
        gt=0,
        description="GET /health answers from Serve's status, read in the background every second; "
        "if the Serve controller has not answered for this long (its head pod gone, or stalled), "
        "each replica answers for itself instead: 200 while its own engine serves, 503 once it failed.",
    )
    responses_store: ResponsesStoreConfig = Field(
        default_factory=ResponsesStoreConfig,
        description="Where stored responses and background answers live (in-process unless redis is set).",
    )
    grpc_stream: GRPCStreamConfig = Field(
        default_factory=GRPCStreamConfig,
        description="Bounds of each multiplexed gRPC call (Generation/Stream).",
    )
    open_calls: OpenCallsConfig = Field(
        default_factory=OpenCallsConfig,
        description="Bounds of calls that stay open without generating (Stream and Resume calls, GETs that "
        "follow an answer).",
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
    sse_keepalive_s: float | None = Field(
        default=15.0,
        gt=0,
        description="A stream with no first chunk after this long (queued, or in a long prefill) gets its "
        "response's headers and an SSE comment (': keep-alive') this often until it begins, so that "
        "proxies and clients that cut idle connections keep it; an error before its first token then ends "
        "it as an error event, not a status. null: the status waits for the first token.",
    )
    stream_stall_timeout_s: float | None = Field(
        default=60.0,
        gt=0,
        description="A stream that waits this long for its next token while its replica's other streams "
        "get theirs is ended with an error event (504 stream_stalled) and its engine request aborted. "
        "null: no watchdog.",
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
    def isolates_prefix_cache(self) -> bool:
        """Whether each key's prompts are cached apart: prefix_cache_per_key, with keys to tell tenants apart."""
        return self.prefix_cache_per_key and self.api_keys is not None

    @property
    def applies_fair_share(self) -> bool:
        """Whether places are shared fairly between API keys: fair_share, with keys to tell tenants apart."""
        return self.fair_share and self.api_keys is not None
