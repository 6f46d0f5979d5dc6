"""The applications the suite serves, both from the serve configs under ``deploy/``.

- ``glm`` at ``/``: ``deploy/config.cpu.yaml`` as shipped, the real vLLM CPU engine on the
  tiny GLM-4 model. The tests of generation run on it: protocol, GLM-4's format and tools,
  exact lengths, the same seed over HTTP and gRPC, the README's examples, and the one
  canary whose engine process really dies.
- ``glm-sim`` at ``/sim``, *the bed*: ``deploy/config.sim.yaml``'s application, the
  production shape on the simulated engine, which stands in for the GPU: it costs the host
  almost no CPU, as a GPU engine does, and it is driven through
  :mod:`serve_app.simulated_engine.controls` (pause, pace, fail, hang). The tests of the
  serving layer under load and faults run on it. What differs from the shipped config, and
  why, is :func:`bed_application`'s list.

The cluster-wide options are the CPU config's, as ``make serve`` runs it, but for the ports and
the proxies' time limits: those are deploy/config.sim.yaml's (production's, 960 s), so that each
application's own limits end its requests, and an answer may outlive Serve's default HAProxy
hard stop (120 s) as production's do (test_rollout).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
CPU_CONFIG = REPO / "deploy" / "config.cpu.yaml"
SIM_CONFIG = REPO / "deploy" / "config.sim.yaml"
BED_NAME = "glm-sim"
BED_ROUTE = "/sim"
# Short enough that the hang test's watchdog acts within seconds; a paused engine keeps
# reporting (heartbeats), so only a hang trips it.
BED_STALL_TIMEOUT_S = 5
# Requests on the bed: the CPU config's limits (a time-limit test waits them out).
BED_REQUEST_TIMEOUT_S = 60
# Serve's health checks of the bed's model replicas (shipped: every 10 s, 30 s timeout, 3
# failures), so a dead or hung engine's replica is replaced within seconds, not a minute.
BED_HEALTH_CHECK_PERIOD_S = 2
BED_HEALTH_CHECK_TIMEOUT_S = 5
# How long Serve takes at most to replace a failed bed replica: three failed checks, then its
# drain (the suite's cluster drains for 1 s), with room over what was measured.
BED_REPLACES_S = 3 * (BED_HEALTH_CHECK_PERIOD_S + BED_HEALTH_CHECK_TIMEOUT_S) + 60


@dataclass(frozen=True)
class RunningApp:
    """One application of the suite's running Serve config, as its clients see it."""

    name: str  # Serve's application name (the gRPC proxy routes by it: `application` metadata)
    origin: str  # the HTTP server every application's routes hang below (http://host:port)
    route_prefix: str
    grpc_target: str  # host:port of Serve's gRPC proxy
    model: str
    model_path: Path  # the engine's checkpoint (or the simulated engine's tokenizer)
    log_path: Path  # `serve run`'s output
    config_path: Path  # the suite's whole config, as `serve run` was given it

    @property
    def url(self) -> str:
        """This application's HTTP base URL (its route prefix included)."""
        return self.origin + self.route_prefix.rstrip("/")

    @property
    def model_deployment(self) -> str:
        return "model-" + self.model

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def cpu_application() -> dict[str, Any]:
    """deploy/config.cpu.yaml's application, as shipped."""
    return yaml.safe_load(CPU_CONFIG.read_text())["applications"][0]


def bed_application() -> dict[str, Any]:
    """deploy/config.sim.yaml's application as the suite's bed. What differs from it:

    - its name and route (``glm-sim`` at ``/sim``), beside the CPU app;
    - no model load time (``load_s`` 0): a replacement replica serves within seconds;
    - one model replica, not autoscaling: a burst sized for one replica's queue meets exactly
      that (the autoscale test sets autoscaling back);
    - the CPU config's time limits (request 60 s, first token 30 s, drain 60 s): the tests that
      wait one out wait seconds, not production's minutes;
    - ``engine_stall_timeout_s`` 5, so that a hung engine is caught within seconds;
    - health checks every 2 s with a 5 s timeout (shipped: 10 s and 30 s), so that Serve
      replaces a dead engine's replica within seconds.
    """
    application = yaml.safe_load(SIM_CONFIG.read_text())["applications"][0]
    application["name"], application["route_prefix"] = BED_NAME, BED_ROUTE
    (model,) = application["args"]["models"]
    model["simulated_engine"]["load_s"] = 0
    model["engine_stall_timeout_s"] = BED_STALL_TIMEOUT_S
    deployment = model["deployment"]
    deployment.pop("autoscaling_config")
    deployment["num_replicas"] = 1
    deployment["graceful_shutdown_timeout_s"] = BED_REQUEST_TIMEOUT_S
    deployment["health_check_period_s"] = BED_HEALTH_CHECK_PERIOD_S
    deployment["health_check_timeout_s"] = BED_HEALTH_CHECK_TIMEOUT_S
    ingress = application["args"]["ingress"]
    ingress["request_timeout_s"], ingress["first_token_timeout_s"] = BED_REQUEST_TIMEOUT_S, 30
    return application


def bed_autoscaling() -> dict[str, Any]:
    """The model deployment's autoscaling_config as deploy/config.sim.yaml ships it."""
    (model,) = yaml.safe_load(SIM_CONFIG.read_text())["applications"][0]["args"]["models"]
    return copy.deepcopy(model["deployment"]["autoscaling_config"])


# API keys of the variants that need them (never real keys: the suite's own).
FLOOD_KEY, LIGHT_KEY = "sk-e2e-flood-6d2a91-0123456789", "sk-e2e-light-1c77f0-0123456789"
LIMITED_KEYS = ("sk-e2e-requests-9d01be-0123456789", "sk-e2e-tokens-0a7f3c-0123456789")
REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE = 12, 1200
# The small-queue variant's model replica: it takes TAKES requests at once and QUEUES more waiting.
TAKES, QUEUES = 2, 2
# How long ``direct``'s replicas take Serve's controller's silence before answering /health for
# themselves (production: 30 s; the test stops the controller this long and a little more).
HEALTH_MAX_AGE_S = 3.0
# ``direct``'s streams not yet begun get a keep-alive this often (shipped: 15 s), so that a test sees a few.
KEEPALIVE_S = 1.0
# Serve's production drain of a stopping HAProxy-fronted replica (the suite's cluster drains 1 s).
PRODUCTION_DRAIN_S = 30
# glm-rollout's limit on a request, and its replicas' graceful stop: long enough for answers that
# outlive Serve's default HAProxy hard stop (120 s) after a reload, as production's may (900 s).
ROLLOUT_ANSWER_S = 600
# What glm-autoscaled changes in deploy/config.sim.yaml's autoscaling: from one replica, and the
# shipped 10 s upscale delay with a 10 s downscale delay (not 60 s) and look-back (Serve's
# default: 30 s), so that it scales out and back within the test. (At 2 s up and 5 s down over a
# 5 s look-back it flapped: replicas still starting under load were stopped and started again.)
# And a target of 16 ongoing requests per replica, not 48: the same policy at a third of the
# scale, so that a third of the clients (test_autoscale.py) ask for the same replicas, and the
# suite's 2 cores spend a third of the HTTP and token work on them.
AUTOSCALED = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "downscale_delay_s": 10,
    "look_back_period_s": 10,
    "target_ongoing_requests": 16,
}
# A simulated GPU stepping about four times slower than an H100 (a step of about 27 ms), for the
# variants whose tests hold many clients streaming for a while, where what is proven does not
# depend on the pace: every token streamed costs the suite's 2 cores HTTP work. glm-autoscaled:
# Serve scales on how many requests are ongoing, not on tokens, and at an H100's pace its one
# replica turned out 5,000 tokens a second to 128 clients, which took both cores; on a slower CI
# machine answers then took past the bed's 60 s request timeout (504). glm-rollout: 16 clients
# stream through a rollout that lasts Serve's production drain (30 s) and more.
SLOWER_STEPS = {"step_launch_ms": 20.0}
# glm-keyed's autoscaling: Serve's autoscaler at one replica, no fewer, no more, reading its
# replicas' reports each half second over a 2 s look-back, so that what it reads follows a load
# within seconds (test_answers_as_work reads it), and the shipped target of 48 per replica.
COUNTED = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 1,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "target_ongoing_requests": 48,
}
# glm-keyed's idle Stream calls end after this (shipped: 300 s), so that a test sees it.
IDLE_S = 5.0
# glm-limited's background answers of one key waiting for its place, at most (shipped: 16).
WAITING_PER_KEY = 3
# prefix's store (test_stored_responses): a producer's lease of 2 s (shipped: 10 s), so that a
# reader ends the answer of a killed replica within seconds; responses kept 10 s after their last
# change (shipped: a day), so that the expiry test waits seconds.
STORED = {"lease_s": 2.0, "ttl_s": 10.0}


def variant(name: str, route: str) -> dict[str, Any]:
    """The bed's application under another name and route, its replicas asking Ray for no CPU (the
    simulated engine costs little), so that the bed's own (up to 4, in one test) and the CPU apps'
    still fit the suite's 2 logical CPUs."""
    app = bed_application()
    app["name"], app["route_prefix"] = name, route
    (model,) = app["args"]["models"]
    model["deployment"]["ray_actor_options"] = {"num_cpus": 0}
    return app


def with_keys(app: dict[str, Any], keys_file: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    keys_file.write_text("".join(f"{key}\n" for key in keys))
    app["args"]["ingress"]["api_keys"] = {"file": str(keys_file)}
    return app


def variant_applications(workdir: Path) -> list[dict[str, Any]]:
    """The bed's variants the suite deploys once, beside the CPU app and the bed, so that no test
    deploys and restores one around itself (their key files written to ``workdir``):

    - ``glm-keyed`` (``/keyed``): two API keys, and so fair share between them (test_fair_share),
      each one's prompts cached apart (test_tenant_cache) and each one's stored responses
      (test_stored_responses); autoscaling held at one replica (COUNTED), its Stream calls idle
      after IDLE_S (test_answers_as_work);
    - ``glm-limited`` (``/limited``): the same keys, each held to 2 requests at once by the
      rate limiter, one replica of it (test_fair_share), and trusting each other with the prefix
      cache (test_tenant_cache); at most WAITING_PER_KEY background answers of a key waiting for
      its place (test_answers_as_work);
    - ``glm-rate-limited`` (``/rate-limited``): two model replicas answering clients, each key held
      to REQUESTS_PER_MINUTE and TOKENS_PER_MINUTE across both (test_rollout);
    - ``glm-rollout`` (``/rollout``): the bed with Serve's production drain, SLOWER_STEPS and
      ROLLOUT_ANSWER_S, which the rollout test replaces while streams run (test_rollout);
    - ``direct`` (``/direct``): a model replica taking TAKES requests and queueing QUEUES, and
      answering ``/health`` for itself HEALTH_MAX_AGE_S after Serve's controller went quiet, and
      keeping a stream that has not begun alive every KEEPALIVE_S (test_direct_streaming);
    - ``prefix`` (``/prefix``): two model replicas, routed by prefix (test_prefix_routing,
      test_simulated_engine; a dead engine's replica in test_direct_streaming), its responses in
      the suite's Redis with STORED's shorter lease and expiry (test_stored_responses, which calls
      each replica at its own port, and so does not depend on the routing);
    - ``glm-autoscaled`` (``/autoscaled``): deploy/config.sim.yaml's autoscaling from one replica
      (test_autoscale), with AUTOSCALED's shorter delays, look-back and smaller target so that it scales out and
      back within the test, and SLOWER_STEPS;
    """
    keyed = with_keys(variant("glm-keyed", "/keyed"), workdir / "keyed-keys", (FLOOD_KEY, LIGHT_KEY))
    (model,) = keyed["args"]["models"]
    del model["deployment"]["num_replicas"]
    model["deployment"]["autoscaling_config"] = bed_autoscaling() | COUNTED
    keyed["args"]["ingress"]["grpc_stream"] = {"idle_timeout_s": IDLE_S}
    limited = with_keys(variant("glm-limited", "/limited"), workdir / "limited-keys", (FLOOD_KEY, LIGHT_KEY))
    # (one limiter replica: its test needs no second, which tests/e2e/test_rollout.py proves on glm-rate-limited)
    limited["args"]["ingress"]["rate_limits"] = {"max_concurrent_requests": 2, "deployment": {"num_replicas": 1}}
    # (and its keys trust each other: they share the prefix cache, test_tenant_cache)
    limited["args"]["ingress"]["prefix_cache_per_key"] = False
    limited["args"]["ingress"]["responses_store"] |= {"max_waiting_per_key": WAITING_PER_KEY}
    rate_limited = with_keys(variant("glm-rate-limited", "/rate-limited"), workdir / "rate-keys", LIMITED_KEYS)
    rate_limited["args"]["ingress"]["rate_limits"] = {
        "requests_per_minute": REQUESTS_PER_MINUTE,
        "tokens_per_minute": TOKENS_PER_MINUTE,
    }
    (model,) = rate_limited["args"]["models"]
    model["deployment"]["num_replicas"] = 2
    # The checks' requests share one prompt: picked by load (of two), not kept together by it.
    model["prefix_routing"]["enabled"] = False
    rollout = variant("glm-rollout", "/rollout")
    drain = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(PRODUCTION_DRAIN_S)}
    rollout.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(drain)
    (model,) = rollout["args"]["models"]
    model["simulated_engine"] |= SLOWER_STEPS
    model["deployment"]["graceful_shutdown_timeout_s"] = ROLLOUT_ANSWER_S
    rollout["args"]["ingress"]["request_timeout_s"] = ROLLOUT_ANSWER_S
    direct = variant("direct", "/direct")
    (model,) = direct["args"]["models"]
    model["deployment"] |= {"max_ongoing_requests": TAKES, "max_queued_requests": QUEUES}
    direct["args"]["ingress"]["health_max_age_s"] = HEALTH_MAX_AGE_S
    direct["args"]["ingress"]["sse_keepalive_s"] = KEEPALIVE_S
    prefix = variant("prefix", "/prefix")
    (model,) = prefix["args"]["models"]
    assert model["prefix_routing"]["enabled"]  # the shipped config routes by prefix
    model["deployment"]["num_replicas"] = 2
    prefix["args"]["ingress"]["responses_store"] |= STORED
    autoscaled = variant("glm-autoscaled", "/autoscaled")
    (model,) = autoscaled["args"]["models"]
    del model["deployment"]["num_replicas"]
    model["deployment"]["autoscaling_config"] = bed_autoscaling() | AUTOSCALED
    model["simulated_engine"] |= SLOWER_STEPS
    return [keyed, limited, rate_limited, rollout, direct, prefix, autoscaled]


# The applications a few modules use, each removed once no test still to run names it in its
# module's ``applications`` marker (conftest.py); the CPU app and the bed stay to the end.
RETIRABLE = frozenset(
    {
        "glm-keyed",
        "glm-limited",
        "glm-rate-limited",
        "glm-rollout",
        "direct",
        "prefix",
        "glm-autoscaled",
        "glm-w4a16",
    }
)

# Applications the suite deploys once the others answer, so that the first tests wait for fewer
# starts: the 4-bit app's CPU engine, whose start took CPU from the CPU app's (its compile is the
# longest part of the suite's start), is not needed before test_quantised_serving. (Deferring the
# variants whose modules run late too made the start 61 s shorter and the first test 73 s longer:
# their starts took the same CPU from the first tests, and Serve's controller answered the first
# test's status call 77 s late while it deployed them; docs/testing.md.)
STARTED_LATER = frozenset({"glm-w4a16"})

QUANTISED_CHECKPOINT = "models/tiny-glm4-w4a16"  # `make tiny-model` writes it


def cpu_runs_4_bit_weights() -> bool:
    """Whether vLLM's CPU engine can generate with 4-bit weights here: its CPUWNA16 kernel
    (``cpu_gemm_wna16``) is built into its AVX-512 libraries only, and on x86 vLLM loads its AVX2
    library where torch reports no AVX-512 (vllm/platforms/cpu.py ``import_kernels``): the engine
    then starts and dies on its first forward pass."""
    import platform

    import torch

    return platform.machine() != "x86_64" or torch.cpu._is_avx512_supported()


def quantised_application() -> dict[str, Any]:
    """``glm-w4a16`` (``/w4a16``): deploy/config.cpu.yaml's application serving the tiny model's
    4-bit copy with an FP8 KV cache, one replica (test_quantised_serving). Run eagerly
    (``enforce_eager``, vLLM's own argument): the same 4-bit kernels and KV cache without torch's
    inductor compiling the model as the engine starts (a minute of CPU with a cold
    compile cache, on the suite's start, for a few requests)."""
    app = cpu_application()
    app["name"], app["route_prefix"] = "glm-w4a16", "/w4a16"
    (model,) = app["args"]["models"]
    model["engine_args"] |= {
        "model": QUANTISED_CHECKPOINT,
        "quantization": "compressed-tensors",
        "kv_cache_dtype": "fp8",
        "enforce_eager": True,
    }
    model["deployment"].pop("autoscaling_config", None)
    model["deployment"]["num_replicas"] = 1
    return app


def suite_config(http_port: int, grpc_port: int, env_vars: dict[str, str], workdir: Path) -> dict[str, Any]:
    """The serve config the suite runs: the CPU app, the bed and its variants, the 4-bit app where
    this CPU can generate with it, ``env_vars`` added to each."""
    config = yaml.safe_load(CPU_CONFIG.read_text())
    production = yaml.safe_load(SIM_CONFIG.read_text())
    for proxy, port in (("http_options", http_port), ("grpc_options", grpc_port)):
        config[proxy]["port"] = port
        config[proxy]["request_timeout_s"] = production[proxy]["request_timeout_s"]
    config["applications"] = [
        cpu_application(),
        bed_application(),
        *variant_applications(workdir),
        *([quantised_application()] if cpu_runs_4_bit_weights() else []),
    ]
    for application in config["applications"]:
        application.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env_vars)
    return config


def application(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The application called ``name`` in a serve config (to change it in place)."""
    (found,) = [a for a in config["applications"] if a["name"] == name]
    return found
