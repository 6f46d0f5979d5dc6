"""The load benchmark against the real app: every request streams its exact token count, and
the JSON and the plot are written. (Figures are reported by the benchmark, not asserted.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.load import main


async def test_benchmark_measures_the_app(app, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "--url",
        app.url,
        "--model",
        app.model,
        "--concurrency",
        "1",
        "4",
        "--requests",
        "8",
        "--input-tokens",
        "16",
        "--output-tokens",
        "8",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--plot",
        str(plot),
    ]
    result = await asyncio.to_thread(main, argv)  # it runs its own event loop
    assert [level["failed"] for level in result["levels"]] == [0, 0], [lv["errors"] for lv in result["levels"]]
    for level in result["levels"]:
        assert level["requests"] == 8 and level["output_tokens_per_s"] > 0
        assert all(r["output_tokens"] == 8 and r["ttft_s"] <= r["e2e_s"] for r in level["records"])
    assert json.loads(out.read_text())["levels"][1]["load"]["concurrency"] == 4
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("protocol", ["grpc", "grpc-stream"])
async def test_benchmark_measures_the_grpc_api_on_the_same_load(app, protocol):
    """``--protocol grpc`` (a call per request) and ``grpc-stream`` (the requests in flight on one
    multiplexed call): the same workload through the gRPC API; every answer streams its exact count."""
    argv = ["--protocol", protocol, "--grpc-target", app.grpc_target, "--grpc-application", app.name]
    argv += ["--model", app.model, "--endpoint", "chat"]
    argv += ["--concurrency", "4", "--requests", "8", "--input-tokens", "16", "--output-tokens", "8", "--warmup", "1"]
    result = await asyncio.to_thread(main, argv)
    (level,) = result["levels"]
    assert result["protocol"] == protocol and level["failed"] == 0, level["errors"]
    assert all(r["output_tokens"] == 8 and r["ttft_s"] <= r["e2e_s"] for r in level["records"])


async def test_vllm_bench_serve_measures_the_app(app, tmp_path):
    """vLLM's own serving benchmark, unchanged, against the app: every request completes."""
    from benchmarks.vllm_bench_serve import main as vllm_bench_serve

    argv = [
        "--backend",
        "openai",
        "--base-url",
        app.url,
        "--model",
        app.model,
        "--tokenizer",
        str(app.model_path),
        "--dataset-name",
        "random",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--num-prompts",
        "8",
        # ignore_eos switches GLM-4's stop tokens off, as in bare vLLM: every answer has 8 tokens.
        "--max-concurrency",
        "4",
        "--ignore-eos",
        "--seed",
        "1",
    ]
    result = await asyncio.to_thread(vllm_bench_serve, argv)  # it runs its own event loop
    assert (result["completed"], result["failed"]) == (8, 0), result.get("errors")
    assert result["total_output_tokens"] == 8 * 8


async def test_hostile_bodies_benchmark_streams_while_bodies_are_refused(app):
    """Small and short here; the figures in the docs come from its defaults (8 MB at 10/s)."""
    from benchmarks.hostile_bodies import main as hostile_bodies

    argv = ["--url", app.url, "--model", app.model, "--tokens", "64", "--body-bytes", "400000", "--per-second", "4"]
    result = await asyncio.to_thread(hostile_bodies, argv)
    assert result["quiet"]["ok"] and result["under hostile bodies"]["ok"], result
    # Every hostile body refused: 400, or 429 while more than 8 wait for the checker process (it may still be starting).
    statuses = result["hostile"]["statuses"]
    assert 400 in statuses and set(statuses) <= {400, 429}, result["hostile"]


async def test_health_under_burst_benchmark_probes_while_requests_run(app):
    from benchmarks.health_under_burst import main as health_under_burst

    argv = ["--url", app.url, "--model", app.model, "--burst", "16", "--tokens", "8", "--poll-ms", "20"]
    result = await asyncio.to_thread(health_under_burst, argv)
    assert result["burst"]["statuses"] == {200: 16}, result["burst"]
    assert result["health"]["probes"] >= 1 and set(result["health"]["statuses"]) == {200}
