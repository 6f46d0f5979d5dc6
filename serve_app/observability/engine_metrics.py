"""vLLM's engine metrics, exported through Ray's metrics, with gauges that last while idle.

vLLM's ``RayPrometheusStatLogger`` sets its gauges (requests running and
waiting, KV cache usage) after each engine step, so they stop being set when the
engine is idle and Ray drops their series (:mod:`serve_app.observability.gauges`).
Here the logger's gauges set through this process's :class:`KeptGauges`, and
start at 0 before the engine's first step, as do its prefix-cache counters (a
hit rate of 0 is a value, not "no data"); the reach into vLLM's metrics is
:func:`serve_app.vllm_internals.ray_stat_logger`.
"""

from __future__ import annotations

from typing import Any

from serve_app import vllm_internals
from serve_app.observability.gauges import kept_gauges
from serve_app.observability.metrics import start_at_zero


def engine_stat_logger() -> type:
    """vLLM's Ray stat logger whose gauges keep their last value (exported as ``ray_vllm_*``)."""

    def set_kept(metric: Any, value: float, tags: dict[str, str]) -> None:
        kept_gauges().set(metric, value, tags)

    return vllm_internals.ray_stat_logger(set_kept, start_at_zero)
