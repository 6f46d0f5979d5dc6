"""vLLM's engine metrics, exported through Ray's metrics, with gauges that last while idle.

vLLM's ``RayPrometheusStatLogger`` sets its gauges (requests running and
waiting, KV cache usage) after each engine step, so they stop being set when the
engine is idle and Ray drops their series (:mod:`serve_app.observability.gauges`).
Here the logger's gauges set through this process's :class:`RefreshedGauges`, and
start at 0 before the engine's first step, as do its prefix-cache counters (a
hit rate of 0 is a value, not "no data"); the reach into vLLM's metrics is
:func:`serve_app.vllm_internals.ray_stat_logger`.

Runs in each model replica: vLLM calls its stat loggers after each engine step.
"""

from __future__ import annotations

from typing import Any

from serve_app import vllm_internals
from serve_app.observability.gauges import refreshed_gauges
from serve_app.serve_internals import start_at_zero


def engine_stat_logger() -> type:
    """vLLM's Ray stat logger whose gauges keep their last value (exported as ``ray_vllm_*``)."""

    def set_refreshed(metric: Any, value: float, tags: dict[str, str]) -> None:
        refreshed_gauges().set(metric, value, tags)

    return vllm_internals.ray_stat_logger(set_refreshed, start_at_zero)


ENGINE_INFO = "glm4_serve_engine_info"  # exported as ray_glm4_serve_engine_info


def engine_info_tags(model: str, vllm_config: Any) -> dict[str, str]:
    """What an engine runs, as vLLM resolved it from the engine arguments and the checkpoint:
    activations' ``dtype``, weight ``quantization`` (``none``, or the method vLLM chose, such as
    ``fp8`` or ``compressed-tensors``) and ``kv_cache_dtype`` (``auto`` is the activations')."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    return {
        "model": model,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "quantization": str(model_config.quantization or "none"),
        "kv_cache_dtype": str(cache_config.cache_dtype),
    }


def report_engine_info(model: str, vllm_config: Any) -> None:
    """Export 1 with :func:`engine_info_tags` for as long as this replica lives, so a dashboard or a
    test reads which variant each replica serves (bf16, FP8, 4-bit) from the metrics."""
    from ray.serve.metrics import Gauge

    gauge = Gauge(
        ENGINE_INFO,
        "1 for each model replica, tagged with its engine's dtype, weight quantization and KV cache dtype.",
        tag_keys=("model", "dtype", "quantization", "kv_cache_dtype"),
    )
    refreshed_gauges().set(gauge, 1, engine_info_tags(model, vllm_config))
