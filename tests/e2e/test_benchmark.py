"""The load benchmark against the real app: every request streams its exact token count, and
the JSON and the plot are written. (Figures are reported by the benchmark, not asserted.)"""

from __future__ import annotations

import asyncio
import json

from benchmarks.load import main


async def test_benchmark_measures_the_app(app, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--url", app.url, "--model", app.model, "--concurrency", "1", "4", "--requests", "8",
            "--input-tokens", "16", "--output-tokens", "8", "--warmup", "1", "--out", str(out), "--plot", str(plot)]
    result = await asyncio.to_thread(main, argv)  # it runs its own event loop
    assert [level["failed"] for level in result["levels"]] == [0, 0], [lv["errors"] for lv in result["levels"]]
    for level in result["levels"]:
        assert level["requests"] == 8 and level["output_tokens_per_s"] > 0
        assert all(r["output_tokens"] == 8 and r["ttft_s"] <= r["e2e_s"] for r in level["records"])
    assert json.loads(out.read_text())["levels"][1]["load"]["concurrency"] == 4
    assert plot.read_bytes()[:4] == b"\x89PNG"
