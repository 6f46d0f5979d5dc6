"""The load benchmark's arithmetic and outputs (its run against the real app is in tests/e2e)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from benchmarks.client import Workload, carries_tokens
from benchmarks.load import Load, levels_from, parse_args
from benchmarks.plot import plot_levels
from benchmarks.records import RequestRecord, percentiles, summarize
from serve_app.config import parse_app_config
from serve_app.glm4 import sizing
from tests.waiting import wait_until_blocking

REPO = Path(__file__).resolve().parents[2]


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    record = RequestRecord(ok=True, ttft_s=0.1, e2e_s=1.1, output_tokens=11)
    assert record.tpot_s == pytest.approx(0.1)
    assert RequestRecord(ok=True, ttft_s=0.1, e2e_s=0.2, output_tokens=1).tpot_s is None


def test_percentiles_are_in_milliseconds():
    figures = percentiles([i / 1000 for i in range(1, 101)])
    assert figures["p50"] == pytest.approx(50.5) and figures["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_summary_counts_only_successful_requests_in_latency_and_throughput():
    records = [
        RequestRecord(ok=True, ttft_s=0.02, e2e_s=0.5, output_tokens=64, gaps_s=[0.01, 0.03]),
        RequestRecord(ok=True, ttft_s=0.04, e2e_s=0.7, output_tokens=64),
        RequestRecord(ok=False, error="503: busy"),
    ]
    summary = summarize({"concurrency": 2}, records, wall_s=2.0)
    assert summary["failed"] == 1 and summary["errors"] == ["503: busy"]
    assert summary["output_tokens_per_s"] == 64.0 and summary["requests_per_s"] == 1.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(30.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(20.0)


def test_workload_asks_for_exact_lengths():
    body = Workload("m", input_tokens=32, output_tokens=64).body()
    assert len(body["prompt"]) == 32 and body["max_tokens"] == 64 and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = Workload("m", 8, 4, endpoint="chat")
    assert chat.path() == "/v1/chat/completions" and "messages" in chat.body()
    responses = Workload("m", 8, 4, endpoint="responses")
    assert responses.path() == "/v1/responses" and responses.body()["max_output_tokens"] == 4
    assert responses.body()["ignore_eos"] is True and responses.body()["stream"] is True


def test_chunks_carry_tokens_even_when_their_text_is_held_back():
    assert carries_tokens({"choices": [{"text": "ab"}]})
    assert carries_tokens({"choices": [{"text": ""}]})  # an unfinished character's bytes
    assert carries_tokens({"choices": [{"delta": {"content": "c"}}]})
    assert carries_tokens({"choices": [{"delta": {"content": ""}}]})
    assert not carries_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not carries_tokens({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert not carries_tokens({"choices": [], "usage": {"completion_tokens": 3}})
    assert carries_tokens({"type": "response.output_text.delta", "delta": ""})  # the Responses API's
    assert not carries_tokens({"type": "response.created", "response": {}})


def test_levels_default_to_enough_requests_per_level():
    args = parse_args(["--model", "m", "--concurrency", "1", "16"])
    assert levels_from(args) == [Load(requests=16, concurrency=1), Load(requests=64, concurrency=16)]
    rates = levels_from(parse_args(["--model", "m", "--rate", "2.5", "--requests", "10"]))
    assert rates == [Load(requests=10, rate=2.5)]


def test_plot_is_written(tmp_path):
    level = summarize(
        {"concurrency": 1, "rate": None, "requests": 1},
        [RequestRecord(ok=True, ttft_s=0.02, e2e_s=0.5, output_tokens=64)],
        1.0,
    )
    result = {
        "url": "http://x",
        "workload": {"model": "m", "input_tokens": 1, "output_tokens": 64},
        "levels": [level, level | {"load": {"concurrency": 4, "rate": None, "requests": 1}}],
    }
    plot_levels(json.loads(json.dumps(result)), tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_both_servers_get_the_configs_engine_args_and_environment(tmp_path):
    import yaml

    from benchmarks.servers import bare_vllm, this_app

    config = yaml.safe_load((REPO / "deploy" / "config.cpu.yaml").read_text())
    config["applications"][0]["args"]["ingress"]["api_keys"] = {"env": "KEYS"}
    entry = config["applications"][0]["args"]["models"][0]
    bare = bare_vllm(config, None, tmp_path, REPO)
    assert yaml.safe_load((tmp_path / "engine_args.yaml").read_text()) == entry["engine_args"]
    assert bare.argv[bare.argv.index("--served-model-name") + 1] == entry["name"]
    assert bare.env == {k: str(v) for k, v in config["applications"][0]["runtime_env"]["env_vars"].items()}

    app = this_app(config, None, tmp_path, REPO)
    served = yaml.safe_load((tmp_path / "serve_config.yaml").read_text())
    args = served["applications"][0]["args"]
    assert served["http_options"]["port"] == int(app.url.rsplit(":", 1)[1])
    assert app.grpc_target is not None and served["grpc_options"]["port"] == int(app.grpc_target.rsplit(":", 1)[1])
    assert args["models"][0]["engine_args"] == entry["engine_args"]
    deployment = args["models"][0]["deployment"]
    assert deployment["num_replicas"] == 1 and "autoscaling_config" not in deployment
    assert "api_keys" not in args["ingress"]  # bare vLLM is measured without keys too
    assert "api_keys" in config["applications"][0]["args"]["ingress"]  # the original is untouched


def test_comparison_reports_each_goal_against_its_target():
    from benchmarks.side_by_side import compare

    def result(ttft: float, e2e: float, tokens_per_s: float) -> dict:
        def level(c: int) -> dict:
            return {
                "load": {"concurrency": c},
                "ttft_ms": {"p50": ttft},
                "e2e_ms": {"p50": e2e},
                "output_tokens_per_s": tokens_per_s,
            }

        return {"levels": [level(1), level(16), level(64)]}

    rows = compare(result(20, 1000, 1000), result(25, 1300, 900))
    assert [(r["goal"].split(",")[0], r["met"]) for r in rows] == [
        ("time to first token p50", True),
        ("end-to-end p50", False),
        ("output tokens/s", True),
    ]
    assert rows[0]["difference"] == 5 and rows[1]["ratio"] == 1.3 and rows[2]["ratio"] == 0.9


def test_the_cpu_share_competitor_runs_only_inside_its_block():
    from benchmarks.cpu_share import busy_process

    with pytest.raises(ValueError, match="within"):
        with busy_process(1.5):
            pass
    with busy_process(0) as nothing:
        assert nothing is None
    with busy_process(0.2) as proc:
        spinner = psutil.Process(proc.pid)
        wait_until_blocking(lambda: sum(spinner.cpu_times()[:2]) >= 0.05, 10, "the spinner using CPU", every_s=0.05)
        assert proc.poll() is None
    assert proc.returncode is not None  # ended with its block


def test_the_simulated_sides_run_the_same_engine_settings(tmp_path):
    """vLLM's front end gets the model's simulated_engine settings; this app, pinned, loads at once."""
    import yaml

    from benchmarks.servers import simulated_vllm, this_app
    from serve_app.config import sized_for

    config = yaml.safe_load((REPO / "deploy" / "config.sim.yaml").read_text())
    entry = config["applications"][0]["args"]["models"][0]
    vllm = simulated_vllm(config, None, tmp_path, REPO)
    assert vllm.argv[1:3] == ["-m", "benchmarks.vllm_frontend"]
    # sized by the model's engine arguments, as this app's replicas size it (serve_app.config.sized_for)
    sized = sized_for(entry["simulated_engine"], entry["engine_args"])
    assert json.loads(vllm.argv[vllm.argv.index("--simulated-engine") + 1]) == sized
    assert vllm.argv[vllm.argv.index("--fingerprint-mode") + 1] == "custom"
    assert yaml.safe_load((tmp_path / "engine_args.yaml").read_text()) == entry["engine_args"]
    this_app(config, None, tmp_path, REPO)
    served = yaml.safe_load((tmp_path / "serve_config.yaml").read_text())["applications"][0]["args"]["models"][0]
    assert served["simulated_engine"] == entry["simulated_engine"] | {"load_s": 0}
    assert served["deployment"]["num_replicas"] == 1


def test_cpu_is_counted_per_role_and_a_new_process_from_zero():
    from benchmarks.serving_overhead import cpu_used

    before = {1: ("Serve proxy", 10.0), 2: ("ingress replica", 5.0)}
    after = {1: ("Serve proxy", 12.5), 2: ("ingress replica", 6.0), 3: ("ingress replica", 0.5)}
    assert cpu_used(before, after) == {"Serve proxy": 2.5, "ingress replica": 1.5}


def test_this_process_is_found_in_its_own_reading():
    import os

    from benchmarks.serving_overhead import cpu_by_process

    seen = cpu_by_process(os.getpid())
    assert os.getpid() in seen and seen[os.getpid()][1] > 0


def test_what_the_timing_model_allows_grows_with_streams_up_to_the_batch():
    from benchmarks.serving_overhead import allowed_tokens_per_s
    from serve_app.config import SimulatedEngineConfig

    settings, workload = SimulatedEngineConfig(), Workload("m", 32, 256)
    step_s = 0.0014 + sizing.weights_gb() * 1e9 / 3.35e12  # launch and sampling, and the bf16 weights: 7.0 ms
    one, batch, beyond = (allowed_tokens_per_s(settings, 64, n, workload) for n in (1, 64, 256))
    assert one == pytest.approx(
        256
        / (
            step_s
            + 32 * 0.031e-3
            + 32 * 40960 / 3.35e12
            + sum(step_s + (32 + k) * 40960 / 3.35e12 for k in range(1, 256))
        )
    )
    assert 60 * one < batch == beyond


def test_the_overhead_goals_compare_both_sides():
    from benchmarks.serving_overhead import goals

    def side(ttft: float, tpot: float, cpu: float, share: float) -> dict:
        return {
            "levels": [
                {
                    "load": {"concurrency": c},
                    "ttft_ms": {"p50": ttft},
                    "tpot_ms": {"p50": tpot},
                    "server_cpu_s_per_1k_tokens": cpu,
                    "share_of_allowed": share,
                }
                for c in (1, 16, 64, 256)
            ]
        }

    rows = goals(side(10, 7.0, 0.1, 0.95), side(14, 8.5, 0.2, 0.91))
    assert [row["met"] for row in rows] == [True, False, False, False, True]
    assert rows[0]["compared"] == 4 and rows[2]["compared"] == 2


def test_the_direct_streaming_goals_compare_against_both_other_sides():
    from benchmarks.serving_overhead import direct_streaming_goals

    def side(ttft: float, cpu: float, share: float) -> dict:
        return {
            "levels": [
                {
                    "load": {"concurrency": c},
                    "ttft_ms": {"p50": ttft},
                    "server_cpu_s_per_1k_tokens": cpu,
                    "share_of_allowed": share,
                }
                for c in (1, 64, 256)
            ]
        }

    vllm, app, rsl = side(10, 0.03, 0.8), side(12.5, 0.06, 0.77), side(13.4, 0.1, 0.75)
    rows = direct_streaming_goals(vllm, app, rsl)
    assert [(row["goal"], "rsl" in row, row["met"]) for row in rows] == [
        ("TTFT p50 at 1 stream (ms)", False, True),
        ("CPU s per 1k tokens at 64", True, True),
        ("CPU s per 1k tokens at 64", False, True),
        ("share of the timing model at 64", True, True),
        ("CPU s per 1k tokens at 256", True, True),
        ("CPU s per 1k tokens at 256", False, True),
        ("share of the timing model at 256", True, True),
    ]
    assert rows[0]["compared"] == 2.5 and rows[1]["compared"] == 0.6
    assert not direct_streaming_goals(vllm, side(14, 0.095, 0.7), rsl)[1]["met"]  # 0.95x is not 0.9x


def test_ray_serve_llm_gets_the_models_engine_arguments_and_the_simulated_engine_hook():
    from benchmarks.ray_serve_llm import HOOK, SETTINGS_ENV, SETUP_HOOK_ENV, llm_config

    entry = {
        "name": "glm-4-9b-chat",
        "engine_args": {"model": "models/tiny-glm4", "max_num_seqs": 64, "enable_prompt_tokens_details": True},
        "simulated_engine": {"load_s": 30},
    }
    config = llm_config(entry, REPO)
    assert config["model_loading_config"] == {
        "model_id": "glm-4-9b-chat",
        "model_source": str(REPO / "models/tiny-glm4"),
    }
    assert config["engine_kwargs"] == {"max_num_seqs": 64}  # vLLM's front-end arguments are not engine arguments
    env = config["runtime_env"]["env_vars"]
    # Sized as the model's engine arguments say (bf16 here), as this app's replicas size it.
    sized = {"load_s": 0, "weights_gb": sizing.weights_gb(), "kv_bytes_per_token": sizing.kv_bytes_per_token()}
    assert env[SETUP_HOOK_ENV] == HOOK and json.loads(env[SETTINGS_ENV]) == sized


def test_the_scale_ramp_goes_up_holds_and_comes_down():
    from benchmarks.scale import users_at

    ramp = [users_at(t, 512, up_s=100, hold_s=50, down_s=100) for t in (0, 50, 100, 149, 200, 250, 300)]
    assert ramp == [0, 256, 512, 512, 256, 0, 0]


def test_scale_windows_count_every_outcome_and_only_complete_answers_in_latency():
    from benchmarks.scale import Outcome, windows

    outcomes = [
        Outcome(0.0, "complete", ttft_s=0.1, ended_s=2.0, tokens=100),
        Outcome(1.0, "complete", ttft_s=0.3, ended_s=8.0, tokens=300),
        Outcome(3.0, "429", ended_s=3.01),
        Outcome(4.0, "error event engine_failed", ttft_s=0.2, ended_s=12.0, tokens=5),
    ]
    first, second = windows(outcomes, end_s=20, width_s=10)
    assert (first["complete"], first["refused_429"], first["failed"]) == (2, 1, 0)
    assert first["tokens_per_s"] == 40 and first["ttft_p50_ms"] == pytest.approx(200)
    assert (second["complete"], second["failed"], second["tokens_per_s"], second["ttft_p50_ms"]) == (0, 1, 0, None)


def test_a_replica_removed_within_a_downscale_delay_of_an_addition_is_flapping():
    from benchmarks.scale import Sample, flapping

    def at(t: float, running: int) -> Sample:
        return Sample(t, users=0, in_flight=0, replicas={"RUNNING": running})

    steady = [at(0, 1), at(10, 2), at(20, 3), at(100, 2), at(200, 1)]
    assert flapping(steady, downscale_delay_s=60) == []
    assert flapping([at(0, 1), at(10, 2), at(30, 1)], downscale_delay_s=60) == [(10, 30)]


async def test_sse_payloads_stay_whole_across_pieces_and_unicode_line_separators():
    import httpx

    from benchmarks.client import sse_payloads

    events = ['{"text": "a\u2028b\\rc"}', '{"text": "\u0085"}', "[DONE]"]
    body = "".join(f"data: {e}\n\n" for e in events[:-1]).encode()
    body += f"event: response.done\ndata: {events[-1]}\n\n".encode()  # (an event that names itself)
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]  # cut anywhere, mid-character too

    async def stream():
        for piece in pieces:
            yield piece

    response = httpx.Response(200, content=stream())
    assert [p async for p in sse_payloads(response)] == events


def test_a_burst_is_summarized_by_its_refusals_and_its_last_answer():
    from benchmarks.burst_admission import Outcome, summarize

    outcomes = [Outcome(429, 1.6), Outcome(200, 44.5), Outcome(429, 8.5), Outcome("ReadTimeout", 3.0)]
    assert summarize(outcomes) == {
        "refused": 2,
        "completed": 1,
        "other": ["ReadTimeout"],
        "first_refusal_s": 1.6,
        "last_refusal_s": 8.5,
        "all_done_s": 44.5,
    }
    assert summarize([])["first_refusal_s"] is None


def test_the_grammar_cost_benchmark_times_each_token_of_a_walk_with_both_backends():
    from transformers import AutoTokenizer

    from benchmarks.grammar_cost import BACKENDS, backend, walk
    from tests.json_schemas import SCHEMAS

    tiny_model = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4"
    if not (tiny_model / "tokenizer.json").exists():
        pytest.fail(f"{tiny_model} is missing: run `make tiny-model`")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    for name in BACKENDS:
        done = walk(backend(name, tokenizer), SCHEMAS["enum_const"], 0, tokenizer.eos_token_id, 200)
        # A bounded schema: the walk ends well within its 200 tokens, each one timed.
        assert done.ended and done.compile_s > 0 and 1 < len(done.step_s) < 200 and all(s > 0 for s in done.step_s)


def test_the_grammar_build_benchmark_builds_specs_at_the_size_bound_three_ways():
    from transformers import AutoTokenizer

    from benchmarks.grammar_build import BOUND, at_the_bound, costs, growing, size
    from benchmarks.grammar_cost import backend
    from serve_app import vllm_internals

    for name, spec in at_the_bound().items():
        assert 0.9 * BOUND < size(spec) <= BOUND, name
    tiny_model = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4"
    if not (tiny_model / "tokenizer.json").exists():
        pytest.fail(f"{tiny_model} is missing: run `make tiny-model`")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ll_tokenizer = vllm_internals.llguidance_tokenizer(tokenizer, len(tokenizer), "\ufdd0")
    engine = backend("guidance", tokenizer)
    for spec in [*growing(1000).values(), {"regex": "[a-z]{3}"}]:
        timings = costs(spec, ll_tokenizer, engine)
        assert all(float(t) >= 0 for t in timings), timings  # each built, none refused
    assert costs({"json": {"type": "array", "uniqueItems": True}}, ll_tokenizer, engine)[1].endswith("(refused)")


def test_the_load_clients_share_one_tls_context_and_ignore_the_proxy_environment(monkeypatch):
    """A level's first wave makes its clients one after another in the loop that times the
    streams; each loading the CA bundle and the proxy environment (43 ms here) delayed the
    first tokens of the streams made before it."""
    import ssl

    from benchmarks.load import Clients

    made = []
    create = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(1) or create(*a, **k))
    clients = Clients("http://127.0.0.1:1", {})
    acquired = [clients.acquire() for _ in range(64)]
    assert len(made) == 1 and len(set(map(id, acquired))) == 64
    assert not any(client.trust_env for client in acquired)


# What Serve's HAProxy manager writes for an application with an ingress request router
# (Ray 2.60's haproxy_templates.py and ingress_request_router.lua.tmpl), cut to the lines read.
HAPROXY_CONFIG = """\
frontend http_frontend
    bind *:8000
backend http-glm
    server SERVE_REPLICA_glm-model-glm-4-9b-chat-bbana2ye 127.0.0.1:30001 check observe layer4
    server SERVE_PROXY_ACTOR-fallback-d83 127.0.0.1:8500 check
backend http-glm-via-ingress-request-router
    server SERVE_REPLICA_glm-model-glm-4-9b-chat-bbana2ye 127.0.0.1:30001 track http-glm/SERVE_REPLICA_glm
backend grpc-glm
    server SERVE_REPLICA_glm-model-glm-4-9b-chat-bbana2ye 127.0.0.1:40000 check
"""
LUA_SCRIPT = """\
local SESSION_HEADER = ""
local ROUTERS = {
    ["http-glm"] = { { host = "127.0.0.1", port = 30000, host_header = "127.0.0.1:30000" } }
}
local REPLICA_TARGETS = {
    ["http-glm"] = { ["SERVE_REPLICA::glm#model#b"] = "SERVE_REPLICA_glm-model-glm-4-9b-chat-bbana2ye" }
}
"""


def test_the_first_token_paths_ports_are_read_from_serves_haproxy_files():
    from benchmarks.first_token_path import picker_port, replica_port

    assert replica_port(HAPROXY_CONFIG) == 30001  # the HTTP backends' replica, not its gRPC port
    assert picker_port(LUA_SCRIPT) == 30000
    with pytest.raises(SystemExit, match="one model replica"):
        replica_port(HAPROXY_CONFIG.replace("30001 track", "30005 track"))
    with pytest.raises(SystemExit, match="no router port"):
        picker_port("local ROUTERS = {\n}\n")


def test_the_fair_share_benchmark_gives_this_apps_config_both_keys_and_the_chosen_fair_share(tmp_path):
    from benchmarks import fair_share, servers

    config = yaml.safe_load((REPO / "deploy" / "config.sim.yaml").read_text())
    servers.this_app(config, None, tmp_path, REPO)
    keys = tmp_path / "api-keys"
    fair_share.with_keys(tmp_path / "serve_config.yaml", keys, fair_share=False)
    written = yaml.safe_load((tmp_path / "serve_config.yaml").read_text())
    ingress = written["applications"][0]["args"]["ingress"]
    assert ingress["api_keys"] == {"file": str(keys)}
    assert ingress["fair_share"] is False
    answers = [fair_share.Answer(200, t / 1000) for t in (10, 20, 30, 40)] + [fair_share.Answer(429, None)]
    assert fair_share.light_summary(answers) == {
        "ttft_p50_ms": 20.0,
        "ttft_p99_ms": 40.0,
        "statuses": {"200": 4, "429": 1},
    }


def test_the_quantised_sizing_estimates_follow_the_engine_arguments():
    from benchmarks.quantised_sizing import A10G, H100, L4, W4A16_GB, estimate

    bf16, fp8_kv = estimate(H100, {}, 2048), estimate(H100, {"kv_cache_dtype": "fp8"}, 2048)
    fp8 = estimate(H100, {"quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8"}, 2048)
    assert (bf16["weights_gb"], fp8["weights_gb"]) == (18.8, 10.6)
    assert abs(fp8_kv["kv_cache_tokens"] - 2 * bf16["kv_cache_tokens"]) <= 1  # same room, half the bytes
    assert fp8["decode_step_ms_1_stream"] < bf16["decode_step_ms_1_stream"]
    assert fp8["conversations_8k"] == fp8["kv_cache_tokens"] // 8192
    assert bf16["tokens_per_s_64"] < fp8_kv["tokens_per_s_64"] < fp8["tokens_per_s_64"]
    assert estimate(L4, {}, 2048)["tokens_per_s_256"] is None  # 256 x 2048 tokens exceed its cache
    # deploy/config.w4a16.yaml's shape: 4-bit weights (given, as compressed-tensors' bits are the
    # checkpoint's) and an FP8 cache give a 24 GB card ten times bf16's cache.
    w4a16 = estimate(A10G, {"quantization": "compressed-tensors", "kv_cache_dtype": "fp8"}, 2048, W4A16_GB)
    assert w4a16["weights_gb"] == 6.7
    assert w4a16["kv_cache_tokens"] > 10 * estimate(A10G, {}, 2048)["kv_cache_tokens"]


def test_the_reloads_benchmark_changes_replicas_beside_args_so_no_replica_is_rebuilt(tmp_path):
    """Its config is the simulated one with a fixed replica count (valid for the app); each change
    sets Serve's own override, never ``args``, which would roll every replica over."""
    from benchmarks.haproxy_reloads import DEPLOYMENT, with_replicas, write_config

    path = tmp_path / "reloads.yaml"
    write_config(path)
    config = yaml.safe_load(path.read_text())
    (app,) = config["applications"]
    (model,) = parse_app_config(app["args"]).models
    assert model.deployment["num_replicas"] == 2 and "autoscaling_config" not in model.deployment
    assert model.simulated_engine is not None and model.simulated_engine.load_s == 0
    changed = with_replicas(config, 3)
    (changed_app,) = changed["applications"]
    assert changed_app["args"] == app["args"]
    assert changed_app["deployments"] == [{"name": DEPLOYMENT, "num_replicas": 3}]
    ServeDeploySchema.model_validate(changed)


def test_the_unauthenticated_bodies_benchmark_nets_out_idling_and_the_keyed_chats() -> None:
    """Per body: the loaded phase's CPU less idling for as long and less the keyed chats' cost."""
    from benchmarks.unauthenticated_bodies import net_cpu_per_body

    # idle: 0.1 CPU-s a second; the keyed chats alone: 2 s of wall, 0.5 CPU-s (0.3 of it theirs)
    per_body = net_cpu_per_body(idle=(1.0, 10.0), alone=(0.5, 2.0), loaded=(1.3, 5.0), bodies=100)
    assert abs(per_body - (1.3 - 0.5 - 0.3) / 100) < 1e-12
