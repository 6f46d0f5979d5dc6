"""What one request measured, and the summary of many: pure data and arithmetic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One streamed request, timed from just before it was sent (seconds)."""

    ok: bool
    ttft_s: float | None = None  # first chunk with output text
    e2e_s: float | None = None  # the [DONE] event
    output_tokens: int = 0  # from the final usage chunk
    gaps_s: list[float] = field(default_factory=list)  # between chunks with output text
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and the mean, in milliseconds; None when there is nothing to summarise."""
    if not values:
        empty: dict[str, float | None] = {f"p{p}": None for p in PERCENTILES}
        return empty | {"mean": None}
    array = np.asarray(values) * 1000
    summary: dict[str, float | None] = {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}
    return summary | {"mean": float(array.mean())}


def summarize(load: dict[str, Any], records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """One load level's figures: latencies in ms, throughput per second of wall time."""
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {
        "load": load,
        "requests": len(records),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": percentiles([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": percentiles([g for r in done for g in r.gaps_s]),
        "e2e_ms": percentiles([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def record_dict(record: RequestRecord) -> dict[str, Any]:
    return asdict(record) | {"tpot_s": record.tpot_s}
