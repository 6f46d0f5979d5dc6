"""Quantised serving on vLLM's CPU engine: 4-bit weights and an FP8 KV cache, for real.

The suite's ``glm-w4a16`` application (under ``/w4a16``: the CPU app with the shape of
deploy/config.w4a16.yaml, tests/e2e/harness/apps.py) serves ``models/tiny-glm4-w4a16``, the tiny model's 4-bit copy
written by serve_app/ops/quantise_w4a16.py (compressed-tensors W4A16, which vLLM's CPU engine runs
with its CPUWNA16 kernels and a GPU with Marlin), with ``kv_cache_dtype: fp8``: on a CPU with
AVX-512 only (``cpu_runs_4_bit_weights``), where the suite deploys it. FP8 weights
do not run on vLLM's CPU build (its FP8 quantisation kernels are CUDA's); their timing is the
simulated engine's (docs/performance-history.md).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serve_app.observability.engine_metrics import ENGINE_INFO
from tests.e2e.harness.apps import (
    QUANTISED_CHECKPOINT,
    REPO,
    RunningApp,
    cpu_runs_4_bit_weights,
)
from tests.e2e.harness.bodies import chat
from tests.e2e.harness.serve_state import DeploymentName
from tests.e2e.harness.sse import post_stream
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, total
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.applications("glm-w4a16"),
    # (and the suite does not deploy the 4-bit app there: harness/apps.py, suite_config)
    pytest.mark.skipif(
        not cpu_runs_4_bit_weights(),
        reason="vLLM's CPU build has its 4-bit kernel (cpu_gemm_wna16) only in its AVX-512 library;"
        " this x86 CPU has no AVX-512",
    ),
]

NAME = "glm-w4a16"
MODEL = DeploymentName(NAME, "model-glm-4-9b-chat")


@pytest.fixture(scope="module")
def quantised(variants: dict[str, RunningApp]) -> RunningApp:
    assert (REPO / QUANTISED_CHECKPOINT / "config.json").exists(), "run `make tiny-model`"
    return variants[NAME]


async def test_the_4_bit_model_answers_with_exactly_the_tokens_asked_for(quantised: RunningApp) -> None:
    async with httpx.AsyncClient(base_url=quantised.url, timeout=120) as client:
        whole = await client.post("/v1/chat/completions", json=chat(quantised.model, 24))
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["usage"]["completion_tokens"] == 24
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["message"]["content"]
        body = chat(quantised.model, 16, stream=True, stream_options={"include_usage": True})
        stream = await post_stream(client, "/v1/chat/completions", body)
        assert stream.status == 200 and stream.done, stream.events[-3:]
        assert stream.chunks[-1]["usage"]["completion_tokens"] == 16
        finish = [c["choices"][0]["finish_reason"] for c in stream.chunks if c.get("choices")]
        assert finish[-1] == "length"


async def test_the_metrics_say_which_weights_and_kv_cache_each_replica_serves(
    quantised: RunningApp, app: RunningApp, metrics_url: str
) -> None:
    """The quantised replica reports vLLM's resolved method and cache dtype; the suite's bf16 CPU
    app, beside it, reports none and auto: the labels come from each engine, not the config file."""
    name = f"ray_{ENGINE_INFO}"

    def info(application: str, **labels: str) -> float:
        return total(scrape(metrics_url), name, application=application, **labels)

    def vllms_cache_config(**labels: str) -> float:
        return total(scrape(metrics_url), "ray_vllm_cache_config_info", **labels)

    quantised_labels = {"quantization": "compressed-tensors", "kv_cache_dtype": "fp8", "dtype": "bfloat16"}
    await wait_until(
        lambda: asyncio.to_thread(info, NAME, **quantised_labels), 60, f"{name} of {NAME}", every_s=SCRAPE_EVERY_S
    )
    assert info(NAME) == 1  # one replica, one series
    assert info(app.name, quantization="none", kv_cache_dtype="auto", dtype="bfloat16") == 1
    # vLLM's own cache-config metric says the same (its gauge is exported on its own schedule).
    fp8 = "ray_vllm_cache_config_info with cache_dtype fp8"
    await wait_until(lambda: asyncio.to_thread(vllms_cache_config, cache_dtype="fp8"), 60, fp8, every_s=SCRAPE_EVERY_S)
