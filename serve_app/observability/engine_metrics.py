"""vLLM's engine metrics, exported through Ray's metrics, with gauges that last while idle.

vLLM's ``RayPrometheusStatLogger`` sets its gauges (requests running and
waiting, KV cache usage) after each engine step, so they stop being set when the
engine is idle and Ray drops their series (:mod:`serve_app.observability.gauges`).
This is the one place the app reaches into vLLM's metrics: the logger's gauge
class (``_gauge_cls``, vLLM's own switch between Prometheus and Ray gauges) is
replaced by one that sets through this process's :class:`KeptGauges`, and the
gauges start at 0 before the engine's first step.
"""

from __future__ import annotations

from typing import Any

from serve_app.observability.gauges import kept_gauges


def engine_stat_logger() -> type:
    """vLLM's Ray stat logger whose gauges keep their last value (exported as ``ray_vllm_*``)."""
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper, RayPrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    class KeptRayGauge(RayGaugeWrapper):
        def set(self, value: int | float) -> Any:
            kept_gauges().set(self.metric, value, self._tags)

    class KeptRayPrometheusStatLogger(RayPrometheusStatLogger):
        _gauge_cls = KeptRayGauge

        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            super().__init__(vllm_config, engine_indexes)
            # An engine that has not run a step yet (a replica scaled out after the load)
            # reads 0 running, 0 waiting, an empty cache: empty stats through vLLM's own
            # record (its counters skip increments of 0).
            for index in self.engine_indexes:
                self.record(SchedulerStats(), None, engine_idx=index)

    return KeptRayPrometheusStatLogger
