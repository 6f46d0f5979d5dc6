"""Application arguments are validated at start, with messages naming the bad field."""

import pytest
import yaml

from serve_app.config import ConfigError, OpenCallsConfig, parse_app_config, split_engine_args
from serve_app.deployments.options import DIRECT_REQUESTS_HEADROOM, model_options, model_server_options
from tests.serve_configs import DEPLOY, SHIPPED, app_args, minimal
from tools.cluster_env import cluster_env


@pytest.mark.parametrize("config_file", SHIPPED)
def test_shipped_configs_are_valid(config_file):
    config = parse_app_config(app_args(config_file))
    model = config.models[0]
    assert model.name == "glm-4-9b-chat"
    # A replica admits exactly what its engine batches at once.
    assert model_options(model)["max_ongoing_requests"] == model.engine_args["max_num_seqs"]
    assert "autoscaling_config" in model.deployment


def test_only_the_simulated_config_simulates_the_engine():
    assert parse_app_config(app_args("config.yaml")).models[0].simulated_engine is None
    assert parse_app_config(app_args("config.cpu.yaml")).models[0].simulated_engine is None
    assert parse_app_config(app_args("config.sim.yaml")).models[0].simulated_engine is not None


def test_the_simulated_config_has_productions_model_deployment_shape():
    """Same batch, concurrency limit and replica range as deploy/config.yaml (delays and CPUs differ)."""
    production = parse_app_config(app_args("config.yaml")).models[0]
    simulated = parse_app_config(app_args("config.sim.yaml")).models[0]
    assert simulated.name == production.name
    assert simulated.engine_args["max_num_seqs"] == production.engine_args["max_num_seqs"] == 64
    assert simulated.deployment["max_ongoing_requests"] == production.deployment["max_ongoing_requests"]
    scaling = ("min_replicas", "max_replicas", "target_ongoing_requests")
    assert [simulated.deployment["autoscaling_config"][k] for k in scaling] == [
        production.deployment["autoscaling_config"][k] for k in scaling
    ]
    assert simulated.engine_args["enable_prefix_caching"] is True
    # Eight replicas fit Ray's two logical CPUs on a 2-core machine, next to the ingress.
    assert 8 * simulated.deployment["ray_actor_options"]["num_cpus"] < 1


def test_a_simulated_gpu_without_room_for_the_kv_cache_is_refused():
    args = minimal(simulated_engine={"gpu_memory_gb": 20, "weights_gb": 18.8})
    with pytest.raises(ConfigError, match=r"args\.models\.0\.simulated_engine: .*no room for the KV cache"):
        parse_app_config(args)
    with pytest.raises(ConfigError, match=r"args\.models\.0\.simulated_engine\.step_ms"):
        parse_app_config(minimal(simulated_engine={"step_ms": 7}))


def test_max_ongoing_requests_defaults_to_max_num_seqs():
    config = parse_app_config(minimal(engine_args={"model": "m", "max_num_seqs": 48}))
    assert model_options(config.models[0])["max_ongoing_requests"] == 48


def test_concurrency_limit_must_be_explicit():
    with pytest.raises(ConfigError, match=r"args\.models\.0: .*max_num_seqs"):
        parse_app_config(minimal(engine_args={"model": "m"}))
    explicit = parse_app_config(minimal(engine_args={"model": "m"}, deployment={"max_ongoing_requests": 4}))
    assert model_options(explicit.models[0])["max_ongoing_requests"] == 4


def test_unknown_engine_argument_is_named():
    with pytest.raises(ConfigError, match=r"args\.models\.0\.engine_args.*max_model_length"):
        parse_app_config(minimal(engine_args={"model": "m", "max_model_length": 10}))


@pytest.mark.parametrize(
    ("engine_args", "names"),
    [
        ({"quantization": "fp9"}, "quantization 'fp9' is not one of vLLM's methods"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype 'int3' is not one of vLLM's"),
        ({"kv_cache_dtype": "float16"}, "kv_cache_dtype: dtype float16 refused"),
    ],
)
def test_a_quantisation_vllm_does_not_know_or_a_float16_kv_cache_is_refused_at_config_time(engine_args, names):
    with pytest.raises(ConfigError, match=r"args\.models\.0\.engine_args: .*" + names):
        parse_app_config(minimal(engine_args={"model": "m", "max_num_seqs": 8, **engine_args}))


def test_vllms_quantisation_methods_and_fp8_kv_cache_are_accepted():
    args = {"model": "m", "max_num_seqs": 8, "quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8"}
    assert parse_app_config(minimal(engine_args=args)).models[0].engine_args["kv_cache_dtype"] == "fp8"


def on_gpu(accelerator_type: str, **engine_args) -> dict:
    """Application args whose one model asks Ray for ``accelerator_type``."""
    return minimal(
        engine_args={"model": "m", "max_num_seqs": 8} | engine_args,
        deployment={"ray_actor_options": {"num_gpus": 1, "accelerator_type": accelerator_type}},
    )


@pytest.mark.parametrize(
    ("accelerator_type", "engine_args", "names"),
    [
        # bf16 weights (18.8 GB) on 24 GB leave 2.9 GB; 128K tokens of bf16 KV take 5.4 GB.
        ("A10G", {"max_model_len": 131072}, r"leave 2\.9 GB .* needs 5\.4 GB .* below 70584"),
        # A compressed-tensors checkpoint is counted at the least any 4-bit method takes.
        ("L4", {"max_model_len": 1_000_000, "quantization": "compressed-tensors"}, r"6\.7 GB of weights"),
        ("T4", {"max_model_len": 4096}, r"T4 \(compute capability 7\.5\) has no bfloat16"),
        ("A100", {"quantization": "fp8_per_channel"}, "fp8_per_channel computes in FP8, which .* A100 has no"),
    ],
)
def test_a_gpu_that_cannot_run_the_model_as_configured_is_refused_with_the_reason(accelerator_type, engine_args, names):
    with pytest.raises(ConfigError, match=r"args\.models\.0: .*" + names):
        parse_app_config(on_gpu(accelerator_type, **engine_args))


@pytest.mark.parametrize(
    ("accelerator_type", "engine_args"),
    [
        ("A10G", {"max_model_len": 32768}),  # bf16, 32K: 1.3 GB of KV
        ("A10G", {"max_model_len": 131072, "quantization": "compressed-tensors", "kv_cache_dtype": "fp8"}),
        ("H100", {"max_model_len": 131072}),
        ("A100", {"quantization": "fp8_per_tensor"}),  # FP8 weights, bf16 arithmetic (Marlin)
        ("MI300X", {"max_model_len": 10_000_000}),  # a type the table does not know: not checked
    ],
)
def test_a_gpu_that_can_run_the_model_as_configured_is_accepted(accelerator_type, engine_args):
    parse_app_config(on_gpu(accelerator_type, **engine_args))


def test_the_simulated_gpu_must_hold_one_max_model_len_sequence():
    """80 GB x 0.9 - 18.8 GB of bf16 weights = 53.2 GB: 1.3 M tokens of bf16 KV, 2.6 M of FP8."""
    simulated = {"simulated_engine": {"load_s": 0}}
    with pytest.raises(ConfigError, match=r"53\.2 GB of KV cache .* max_model_len 2000000 sequence \(81\.9 GB\)"):
        parse_app_config(
            minimal(engine_args={"model": "m", "max_num_seqs": 8, "max_model_len": 2_000_000}, **simulated)
        )
    fp8 = {"model": "m", "max_num_seqs": 8, "max_model_len": 2_000_000, "kv_cache_dtype": "fp8"}
    parse_app_config(minimal(engine_args=fp8, **simulated))


def test_engine_model_is_required():
    with pytest.raises(ConfigError, match=r"args\.models\.0\.engine_args.*'model'"):
        parse_app_config(minimal(engine_args={"max_model_len": 10}))


def test_bad_deployment_option_is_named():
    bad = minimal(deployment={"autoscaling_config": {"min_replicas": -1}})
    with pytest.raises(ConfigError, match=r"args\.models\.0\.deployment: .*autoscaling_config\.min_replicas"):
        parse_app_config(bad)


def test_unknown_top_level_field_is_named():
    with pytest.raises(ConfigError, match=r"args\.modles"):
        parse_app_config(minimal() | {"modles": []})


def test_duplicate_model_names_are_refused():
    args = {"models": minimal()["models"] * 2}
    with pytest.raises(ConfigError, match="repeated: glm-4-9b-chat"):
        parse_app_config(args)


def test_no_models_is_refused():
    with pytest.raises(ConfigError, match=r"args\.models"):
        parse_app_config({"models": []})


def test_served_model_name_comes_from_name():
    with pytest.raises(ConfigError, match="served_model_name"):
        parse_app_config(minimal(engine_args={"model": "m", "served_model_name": "x"}))


def test_engine_and_frontend_arguments_are_split():
    engine, frontend = split_engine_args(
        {"model": "m", "max_model_len": 8, "chat_template": "t.jinja", "enable_auto_tool_choice": True}
    )
    assert engine == {"model": "m", "max_model_len": 8}
    assert frontend == {"chat_template": "t.jinja", "enable_auto_tool_choice": True}


@pytest.mark.parametrize("config_file", SHIPPED)
def test_shipped_configs_pass_ray_serves_own_schema(config_file):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / config_file).read_text()))
    assert [app.import_path for app in schema.applications] == ["serve_app.app:build_app"]


@pytest.mark.parametrize("config_file", SHIPPED)
def test_the_proxys_timeout_outlasts_every_ingress_deadline(config_file):
    """Serve's proxy bounds a request's wait for an ingress replica; it must never end one the ingress still times."""
    serve_config = yaml.safe_load((DEPLOY / config_file).read_text())
    for proxy in ("http_options", "grpc_options"):
        proxy_timeout_s = serve_config[proxy]["request_timeout_s"]
        for app in serve_config["applications"]:
            assert proxy_timeout_s >= parse_app_config(app["args"]).ingress.request_timeout_s + 30, proxy


HARD_STOP_MARGIN_S = 60  # Serve's reload after a change, and the old process's last bytes


@pytest.mark.parametrize("config_file", SHIPPED)
def test_haproxys_old_processes_keep_every_answer_a_config_allows(config_file):
    """A reload (any change of the replicas) must not cut an answer: the old HAProxy process's hard
    stop (deploy/cluster.env) outlasts the longest request Serve lets live, with a margin."""
    hard_stop_s = int(cluster_env()["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"])
    serve_config = yaml.safe_load((DEPLOY / config_file).read_text())
    longest_s = max(serve_config[proxy]["request_timeout_s"] for proxy in ("http_options", "grpc_options"))
    assert hard_stop_s >= longest_s + HARD_STOP_MARGIN_S


@pytest.mark.parametrize("config_file", SHIPPED)
def test_a_grpc_message_is_bounded_where_ray_starts_as_an_http_body_is(config_file):
    """Serve's gRPC servers read messages up to deploy/cluster.env's bound before any of the app's
    code runs; it is the ingress's largest body, so a gRPC client gets no more than an HTTP one."""
    bound = int(cluster_env()["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"])
    for app in yaml.safe_load((DEPLOY / config_file).read_text())["applications"]:
        assert bound == parse_app_config(app["args"]).ingress.max_request_body_bytes, app["name"]


@pytest.mark.parametrize("config_file", SHIPPED)
def test_haproxy_waits_for_a_direct_streaming_body_as_long_as_the_ingress_waits_for_one(config_file):
    """With direct streaming, HAProxy holds a POST until its body has come, for as long as
    deploy/cluster.env says; a shipped config's slow upload must get the time its
    ``ingress.body_timeout_s`` promises, not Serve's default 5 s and HAProxy's 408 page."""
    haproxy_wait_s = int(cluster_env()["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S"])
    for app in yaml.safe_load((DEPLOY / config_file).read_text())["applications"]:
        assert haproxy_wait_s == parse_app_config(app["args"]).ingress.body_timeout_s, app["name"]


@pytest.mark.parametrize("config_file", SHIPPED)
def test_every_shipped_config_serves_the_grpc_api_and_its_health_service(config_file):
    """The servicer functions import (Serve's own model imports them, as its proxy does) and register both services."""
    from unittest.mock import Mock

    from ray.serve.config import gRPCOptions

    options = gRPCOptions.model_validate(yaml.safe_load((DEPLOY / config_file).read_text())["grpc_options"])
    assert options.port == 9000 and options.enable_reflection

    class Recorder:
        def __init__(self) -> None:
            self.services: set[str] = set()

        def add_generic_rpc_handlers(self, handlers) -> None:
            self.services |= {handler.service_name() for handler in handlers}

        def add_registered_method_handlers(self, service, handlers) -> None:
            self.services.add(service)

    server = Recorder()
    for add_servicer in options.grpc_servicer_func_callable:
        add_servicer(Mock(), server)  # as Serve's proxy does: its servicer is a stand-in, the methods are the app's
    assert server.services == {"glm4serve.v1.Generation", "grpc.health.v1.Health"}


def test_time_limits_have_defaults_and_drain_defaults_to_the_longest_answer():
    config = parse_app_config(minimal(engine_args={"model": "m", "max_num_seqs": 8}))
    assert (config.ingress.request_timeout_s, config.ingress.first_token_timeout_s) == (600, 120)
    options = model_options(config.models[0], config.ingress.request_timeout_s)
    assert options["graceful_shutdown_timeout_s"] == 600


def test_drain_shorter_than_the_longest_answer_is_refused():
    args = minimal(engine_args={"model": "m", "max_num_seqs": 8}, deployment={"graceful_shutdown_timeout_s": 30})
    args["ingress"] = {"request_timeout_s": 120}
    with pytest.raises(
        ConfigError, match=r"graceful_shutdown_timeout_s \(30\) is shorter than ingress.request_timeout_s \(120\)"
    ):
        parse_app_config(args)


@pytest.mark.parametrize("key", ["direct_streaming", "deployment"])
def test_a_key_of_the_retired_relay_path_is_refused_by_name(key):
    args = minimal()
    args["ingress"] = {key: {} if key == "deployment" else True}
    with pytest.raises(ConfigError, match=rf"ingress.{key} is no longer read: answers always stream from the model"):
        parse_app_config(args)


def test_retrying_refused_requests_defaults_to_thirty_seconds_and_cannot_be_negative():
    assert parse_app_config(minimal()).ingress.unavailable_retry_s == 30
    args = minimal()
    args["ingress"] = {"unavailable_retry_s": -1}
    with pytest.raises(ConfigError, match=r"ingress.unavailable_retry_s"):
        parse_app_config(args)


def test_chunks_carry_more_tokens_as_the_engine_gets_busier():
    batching = parse_app_config(minimal()).models[0].stream_batching
    assert (batching.requests_per_token, batching.max_tokens_per_chunk) == (4, 8)
    held = [0, 3, 4, 15, 16, 27, 28, 64, 1000]
    assert [batching.tokens_per_chunk(n) for n in held] == [1, 1, 2, 4, 5, 7, 8, 8, 8]


def test_stream_batching_can_be_turned_off_and_is_validated():
    off = parse_app_config(minimal(stream_batching={"max_tokens_per_chunk": 1})).models[0].stream_batching
    assert {off.tokens_per_chunk(n) for n in range(200)} == {1}
    with pytest.raises(ConfigError, match=r"stream_batching.requests_per_token"):
        parse_app_config(minimal(stream_batching={"requests_per_token": 0}))
    with pytest.raises(ConfigError, match=r"stream_batching.max_tokens_per_chunk"):
        parse_app_config(minimal(stream_batching={"max_tokens_per_chunk": 0}))
    with pytest.raises(ConfigError, match=r"stream_batching.every"):
        parse_app_config(minimal(stream_batching={"every": 2}))


def test_work_a_request_may_ask_for_is_bounded_by_default():
    config = parse_app_config(minimal())
    assert config.ingress.max_n == 8 and config.ingress.body_timeout_s == 30
    assert config.models[0].max_output_tokens is None  # the context decides
    capped = minimal(
        engine_args={"model": "m", "max_num_seqs": 8, "override_generation_config": {"max_new_tokens": 64}}
    )
    assert parse_app_config(capped).models[0].max_output_tokens == 64


def test_production_caps_answers_at_8192_tokens():
    assert parse_app_config(app_args("config.yaml")).models[0].max_output_tokens == 8192


def test_a_hung_engine_must_be_noticed_before_requests_time_out():
    assert parse_app_config(minimal()).models[0].engine_stall_timeout_s == 60
    args = minimal(engine_stall_timeout_s=90)
    args["ingress"] = {"request_timeout_s": 90}
    with pytest.raises(ConfigError, match=r"engine_stall_timeout_s \(90\) is not below ingress.request_timeout_s"):
        parse_app_config(args)


@pytest.mark.parametrize("config_file", SHIPPED)
def test_every_shipped_config_caps_serves_router_retry_backoff(config_file):
    """Requests waiting for a full replica retry within 50 ms (Ray's default, 0.5 s, left freed
    slots empty: docs/performance-history.md); Serve reads it in the ingress replica's router."""
    app = yaml.safe_load((DEPLOY / config_file).read_text())["applications"][0]
    assert app["runtime_env"]["env_vars"]["RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S"] == "0.05"


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("pins", "loose"),
    [
        ({}, "revision"),
        ({"revision": "main"}, "revision"),
        ({"revision": "v1.0"}, "revision"),
        ({"revision": COMMIT[:12]}, "revision"),  # a short sha can become ambiguous
        ({"revision": COMMIT, "code_revision": "main"}, "code_revision"),
        ({"revision": COMMIT, "tokenizer_revision": "dev"}, "tokenizer_revision"),
    ],
)
def test_remote_code_from_a_branch_or_tag_is_refused(pins, loose):
    args = minimal(engine_args={"model": "THUDM/glm-4-9b-chat", "max_num_seqs": 8, "trust_remote_code": True} | pins)
    with pytest.raises(ConfigError, match=rf"engine_args: .*pin {loose} to a commit"):
        parse_app_config(args)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"model": "THUDM/glm-4-9b-chat", "trust_remote_code": True, "revision": COMMIT},
        {"model": "THUDM/glm-4-9b-chat", "trust_remote_code": True, "revision": COMMIT, "code_revision": COMMIT},
        {"model": "THUDM/glm-4-9b-chat-hf", "revision": "main"},  # no remote code: nothing of the repo runs
        {"model": str(DEPLOY), "trust_remote_code": True},  # a local directory: what was deployed runs
    ],
)
def test_remote_code_from_a_commit_or_a_local_directory_is_accepted(engine_args):
    parse_app_config(minimal(engine_args=engine_args | {"max_num_seqs": 8}))


@pytest.mark.parametrize("config_file", SHIPPED)
def test_every_shipped_config_caches_prefixes_and_routes_by_them(config_file):
    (model,) = parse_app_config(app_args(config_file)).models
    assert model.engine_args["enable_prefix_caching"] is True
    assert model.engine_args["enable_prompt_tokens_details"] is True  # cached_tokens in each answer's usage
    router = model_options(model)["request_router_config"]
    assert router["request_router_class"] == "serve_app.routing.prefix_router:PrefixAffinityRouter"
    assert router["request_router_kwargs"] | {"max_load_gap": None} == {
        "model": "glm-4-9b-chat",
        "chat_template": None,  # GLM-4's own, as the replicas render
        "max_load_gap": None,
        "block_chars": 64,
        "max_blocks": 200_000,
    }


def test_prefix_routing_off_leaves_serves_default_router_and_a_router_of_ones_own_needs_it_off():
    off = parse_app_config(minimal(prefix_routing={"enabled": False})).models[0]
    assert "request_router_config" not in model_options(off)
    own = {
        "request_router_config": {
            "request_router_class": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
        }
    }
    with pytest.raises(ConfigError, match="prefix_routing.enabled: false"):
        parse_app_config(minimal(deployment=own))
    kept = parse_app_config(minimal(deployment=own, prefix_routing={"enabled": False})).models[0]
    assert model_options(kept)["request_router_config"] == own["request_router_config"]


def test_the_router_class_a_config_names_is_importable_and_serves_base_class():
    from ray.serve._private.request_router.request_router import RequestRouter

    from serve_app.routing.prefix_router import PrefixAffinityRouter

    path = model_options(parse_app_config(minimal()).models[0])["request_router_config"]["request_router_class"]
    module, _, name = path.partition(":")
    assert f"{PrefixAffinityRouter.__module__}:{PrefixAffinityRouter.__name__}" == path
    assert module == "serve_app.routing.prefix_router" and issubclass(PrefixAffinityRouter, RequestRouter), name


def test_an_application_serves_exactly_one_model():
    two = {"models": [minimal()["models"][0], {"name": "other", "engine_args": {"model": "b", "max_num_seqs": 8}}]}
    with pytest.raises(ConfigError, match="models lists 2: an application serves exactly one model"):
        parse_app_config(two)


def test_the_replica_takes_past_its_generation_limit_and_its_open_calls_and_enforces_both_itself():
    """Serve's limit of a model replica is its generation places, its open calls' places and a
    headroom for /health: neither generation nor idle calls can take the places /health needs."""
    model = parse_app_config(minimal(deployment={"max_ongoing_requests": 4, "max_queued_requests": 6})).models[0]
    assert model.generation_limit() == 10
    open_calls = OpenCallsConfig(max_per_replica=100)
    options = model_server_options(model, open_calls=open_calls)
    assert options["max_ongoing_requests"] == 10 + 100 + DIRECT_REQUESTS_HEADROOM
    assert "max_queued_requests" not in options
    unbounded = parse_app_config(minimal()).models[0]  # Serve's default queue: unbounded
    assert unbounded.generation_limit() is None
    assert model_server_options(unbounded, open_calls=open_calls)["max_ongoing_requests"] == 8 + 100 + 64


def test_a_request_may_not_ask_for_more_sequences_than_a_replica_batches():
    config = minimal(engine_args={"model": "m", "max_num_seqs": 4})
    with pytest.raises(ConfigError, match=r"max_sequences_per_request \(8\) is above models\.0\.engine_args"):
        parse_app_config(config)
    allowed = parse_app_config(config | {"ingress": {"max_sequences_per_request": 4}})
    assert allowed.ingress.max_sequences_per_request == 4


def test_fair_share_is_on_by_default_and_refuses_an_engine_scheduling_first_come_first_served():
    keys = {"api_keys": {"env": "KEYS"}}
    assert parse_app_config(minimal() | {"ingress": keys}).ingress.applies_fair_share
    fcfs = minimal(engine_args={"model": "m", "max_num_seqs": 8, "scheduling_policy": "fcfs"})
    with pytest.raises(ConfigError, match="scheduling_policy is 'fcfs': ingress.fair_share schedules"):
        parse_app_config(fcfs | {"ingress": keys})
    assert parse_app_config(fcfs | {"ingress": {"fair_share": False} | keys})
    assert not parse_app_config(fcfs).ingress.applies_fair_share
    model = parse_app_config(minimal()).models[0]
    assert model.with_priority_scheduling().engine_args == model.engine_args | {"scheduling_policy": "priority"}
    assert model.runs_at_once() == 8


@pytest.mark.parametrize(
    "deployment", [{"num_replicas": 2}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}]
)
def test_responses_kept_in_replica_memory_need_a_deployment_of_one_replica(deployment):
    """A second replica would answer a GET, or continue a conversation, with nothing: Redis is required."""
    with pytest.raises(ConfigError, match=r"ingress\.responses_store\.redis"):
        parse_app_config(minimal(deployment=deployment))
    parse_app_config(minimal(deployment=deployment) | {"ingress": {"responses_store": {"redis": {}}}})
    parse_app_config(minimal(deployment={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}))
