"""The serving layer's metrics, through Ray Serve's metrics API.

Ray exports them on every node's Prometheus endpoint (port 8080 with ``make serve``
and on KubeRay pods) with the prefix ``ray_``, and Ray Serve adds the tags
``application``, ``deployment`` and ``replica`` (here: the model replica that
measured). Each metric also carries the ``model`` it is about, and each
histogram and counter the ``protocol`` (``http`` or ``grpc``) the request came
by; a gRPC request's ``status`` is the HTTP status of the same answer. They are measured
where the client's view is: at the front door, from the moment a request arrives
to the moment its last byte is written, so they include queueing in Serve's
router and in the engine. vLLM's own engine metrics (``ray_vllm:*``, one series
per model replica) come from :mod:`serve_app.engine.server`.

Runs in each model replica.
"""

from __future__ import annotations

import itertools
from collections import Counter as Tally
from collections.abc import Sequence
from typing import Any

from serve_app.errors import ENGINE_FAILED, STREAM_STALLED
from serve_app.front_door.telemetry.record import GRAMMAR_OUTCOMES, Phase, RequestRecord
from serve_app.observability.gauges import RefreshedGauges, refreshed_gauges
from serve_app.protocol import EMPTY_CONTENT, EMPTY_TOOL_ARGUMENTS
from serve_app.serve_internals import start_at_zero

# Names as exported (Ray adds the "ray_" prefix); the dashboard test reads them from here.
TIME_TO_FIRST_TOKEN = "glm4_serve_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "glm4_serve_time_per_output_token_seconds"
E2E_LATENCY = "glm4_serve_e2e_request_latency_seconds"
PROMPT_TOKENS = "glm4_serve_prompt_tokens"
COMPLETION_TOKENS = "glm4_serve_completion_tokens"
REQUESTS = "glm4_serve_requests"
REJECTED = "glm4_serve_rejected_requests"
ABORTED = "glm4_serve_aborted_requests"
ENGINE_FAILURES = "glm4_serve_engine_failures"
EMPTY_ANSWERS = "glm4_serve_empty_answers"
GRAMMAR_BUILDS = "glm4_serve_grammar_builds"
KEEPALIVES = "glm4_serve_keepalives"
STALLED_STREAMS = "glm4_serve_stalled_streams"
QUEUED = "glm4_serve_requests_queued"
RUNNING = "glm4_serve_requests_running"

PROTOCOLS = ("http", "grpc")  # the protocol label: the front door a request came in by
# The rpc label of each endpoint's own gRPC call (a request on a multiplexed call: "Stream"); "" for HTTP.
GRPC_METHODS = {"chat": "ChatCompletion", "completion": "Completion"}
UNKNOWN_MODEL = "unknown"  # the model label of a request refused before its model was known

# Error statuses whose share k8s/monitoring/prometheus-rules.yaml alerts on: exported at 0 from
# the start, so the first burst of them is seen by rate() (a series that appears at 150 is not).
ALERTED_STATUSES = ("429", "500", "503", "504")

TTFT_BUCKETS_S = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 160]
TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5]
E2E_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 900, 1800]


class ServingMetrics:
    """Records every generation request once it ends, and keeps the queued and running gauges.

    Created in each model replica (Ray's metrics need a running Ray worker). The
    gauges start at 0 for each of ``models`` and keep reporting while idle
    (:mod:`serve_app.observability.gauges`); the counters of events an operator
    alerts on start at 0 (429s and 5xx of each of ``endpoints``, rejections,
    aborts, engine failures, empty answers), and so do the grammar builds.
    """

    def __init__(
        self, models: Sequence[str] = (), endpoints: Sequence[str] = (), gauges: RefreshedGauges | None = None
    ) -> None:
        from ray.serve.metrics import Counter, Gauge, Histogram

        model = ("model", "protocol")
        self.ttft = Histogram(
            TIME_TO_FIRST_TOKEN,
            "Streams: from request arrival to the first token written to the client.",
            boundaries=TTFT_BUCKETS_S,
            tag_keys=model,
        )
        self.tpot = Histogram(
            TIME_PER_OUTPUT_TOKEN,
            "Streams: time per output token after the first, as the client receives them.",
            boundaries=TPOT_BUCKETS_S,
            tag_keys=model,
        )
        self.e2e = Histogram(
            E2E_LATENCY,
            "Successful answers: from request arrival to the last byte written.",
            boundaries=E2E_BUCKETS_S,
            tag_keys=model,
        )
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of answered requests.", tag_keys=model)
        self.completion_tokens = Counter(COMPLETION_TOKENS, "Tokens generated for clients.", tag_keys=model)
        self.requests = Counter(
            REQUESTS,
            "Generation requests by final HTTP status (a stream ended by an error event counts under"
            " that error's status; 499: the client left), finish reason, and the gRPC method (rpc).",
            tag_keys=("model", "protocol", "rpc", "endpoint", "status", "finish_reason"),
        )
        self.rejected = Counter(
            REJECTED,
            "Requests answered 429: queue full (overloaded) or a key's rate limit.",
            tag_keys=("model", "protocol", "reason"),
        )
        self.aborted = Counter(
            ABORTED,
            "Requests whose client left before the answer ended; generation was aborted.",
            tag_keys=("model", "protocol", "phase"),
        )
        self.engine_failures = Counter(
            ENGINE_FAILURES,
            "Requests whose engine died while generating them; answered with an error, not retried.",
            tag_keys=model,
        )
        self.empty_answers = Counter(
            EMPTY_ANSWERS,
            "Complete answers with nothing in them: ended stop with no text and no tool call"
            " (kind content), or called tools with no arguments (kind tool_arguments).",
            tag_keys=("model", "protocol", "kind"),
        )
        self.grammar_builds = Counter(
            GRAMMAR_BUILDS,
            "Structured-output grammars built at the front door, by outcome: built, grammar_too_costly"
            " (past ingress.max_grammar_build_s), invalid_grammar. A request refused before (its key's"
            " limits, a bad body) has none.",
            tag_keys=("model", "protocol", "outcome"),
        )
        self.keepalives = Counter(
            KEEPALIVES,
            "SSE keep-alive comments sent to streams whose answer had not begun (ingress.sse_keepalive_s).",
            tag_keys=model,
        )
        self.stalled_streams = Counter(
            STALLED_STREAMS,
            "Streams the stall watchdog ended: no token for ingress.stream_stall_timeout_s while the"
            " replica's other streams got theirs.",
            tag_keys=model,
        )
        # The gauges are the model's load, whichever protocol brought it: by model only.
        by_model = ("model",)
        self.queued = Gauge(QUEUED, "Requests sent to a model replica that have no first token yet.", tag_keys=by_model)
        self.running = Gauge(RUNNING, "Requests whose answer is being written.", tag_keys=by_model)
        self._in_phase: Tally[tuple[str, Phase]] = Tally()
        self._gauges = gauges or refreshed_gauges()
        for name in models:
            for gauge in (self.queued, self.running):
                self._gauges.set(gauge, 0, {"model": name})
        for name, protocol in itertools.product([*models, UNKNOWN_MODEL], PROTOCOLS):  # unknown: refused before routing
            of_model = {"model": name, "protocol": protocol}
            for counter, tags in [
                (self.prompt_tokens, of_model),
                (self.completion_tokens, of_model),
                (self.engine_failures, of_model),
                (self.keepalives, of_model),
                (self.stalled_streams, of_model),
                (self.rejected, of_model | {"reason": "overloaded"}),
                (self.rejected, of_model | {"reason": "rate_limit_exceeded"}),
                (self.aborted, of_model | {"phase": "waiting"}),
                (self.aborted, of_model | {"phase": "streaming"}),
                (self.empty_answers, of_model | {"kind": EMPTY_CONTENT}),
                (self.empty_answers, of_model | {"kind": EMPTY_TOOL_ARGUMENTS}),
                *[(self.grammar_builds, of_model | {"outcome": outcome}) for outcome in GRAMMAR_OUTCOMES],
            ]:
                start_at_zero(counter, tags)
            for endpoint in endpoints:  # the statuses the alerting rules divide by the total
                for status in ALERTED_STATUSES:
                    rpc = "" if protocol == "http" else GRPC_METHODS.get(endpoint, "")
                    tags = of_model | {"rpc": rpc, "endpoint": endpoint, "status": status, "finish_reason": ""}
                    start_at_zero(self.requests, tags)

    def moved(self, record: RequestRecord, old: Phase, new: Phase) -> None:
        """Keep the gauges: called by a record on each change of phase once it has a model."""
        model = record.model or ""
        for phase, change in ((old, -1), (new, 1)):
            gauge = self._gauge(phase)
            if gauge is not None:
                self._in_phase[model, phase] += change
                self._gauges.set(gauge, self._in_phase[model, phase], {"model": model})

    def _gauge(self, phase: Phase) -> Any:
        return {Phase.QUEUED: self.queued, Phase.RUNNING: self.running}.get(phase)

    def ended(self, record: RequestRecord) -> None:
        """Count a request that has ended, whatever its end."""
        model = {"model": record.model or UNKNOWN_MODEL, "protocol": record.protocol}
        self.requests.inc(
            tags=model
            | {
                "rpc": record.rpc,
                "endpoint": record.endpoint,
                "status": str(record.status),
                "finish_reason": record.finish_reason or "",
            }
        )
        if record.status == 429:
            self.rejected.inc(tags=model | {"reason": record.error_code or "overloaded"})
        if record.error_code == ENGINE_FAILED:
            self.engine_failures.inc(tags=model)
        elif record.error_code == STREAM_STALLED:
            self.stalled_streams.inc(tags=model)
        if record.keepalives:
            self.keepalives.inc(record.keepalives, tags=model)
        if record.grammar_build is not None:
            self.grammar_builds.inc(tags=model | {"outcome": record.grammar_build})
        if record.aborted:
            self.aborted.inc(tags=model | {"phase": "streaming" if record.first_byte_at else "waiting"})
        if record.outcome is not None:
            self.prompt_tokens.inc(record.outcome.prompt_tokens, tags=model)
            self.completion_tokens.inc(record.outcome.completion_tokens, tags=model)
            if record.status == 200 and record.outcome.empty is not None:
                self.empty_answers.inc(tags=model | {"kind": record.outcome.empty})
        if (ttft := record.ttft_s) is not None:
            self.ttft.observe(ttft, tags=model)
            if (tpot := record.tpot_s) is not None:
                self.tpot.observe(tpot, tags=model)
        if record.status == 200 and not record.aborted and (duration := record.duration_s) is not None:
            self.e2e.observe(duration, tags=model)


def exported_names() -> set[str]:
    """Every sample name these metrics have in Prometheus text, as Ray exports them."""
    histograms = (TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY)
    counters = (
        PROMPT_TOKENS,
        COMPLETION_TOKENS,
        REQUESTS,
        REJECTED,
        ABORTED,
        ENGINE_FAILURES,
        EMPTY_ANSWERS,
        GRAMMAR_BUILDS,
        KEEPALIVES,
        STALLED_STREAMS,
    )
    names = {f"ray_{h}_{suffix}" for h in histograms for suffix in ("bucket", "sum", "count")}
    names |= {f"ray_{c}_total" for c in counters}
    return names | {f"ray_{QUEUED}", f"ray_{RUNNING}"}
