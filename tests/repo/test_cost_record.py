"""benchmarks.cost_record: the ratios of issue 79, its table, and where the table is written."""

from __future__ import annotations

import pytest

from benchmarks.cost_record import REFERENCES, TABLE_END, TABLE_START, TARGETS, ratios, references, table, write_docs


def side(levels: dict[int, tuple[float, float, float | None]]) -> dict:
    """A side's levels: concurrency -> (first token p50 ms, CPU s per 1k tokens, model replica's)."""
    return {
        "levels": [
            {
                "load": {"concurrency": streams},
                "ttft_ms": {"p50": ttft},
                "server_cpu_s_per_1k_tokens": cpu,
                "cpu_s_per_1k_tokens": {} if model is None else {"model replica": model, "HAProxy": cpu - model},
            }
            for streams, (ttft, cpu, model) in levels.items()
        ]
    }


def a_run(app_ttft_64: float = 110.0) -> dict:
    vllm = side({1: (12.0, 1.0, None), 64: (100.0, 0.050, None)})
    app = {
        "chat": side({1: (13.5, 2.0, 1.0), 64: (app_ttft_64, 0.060, 0.045)}),
        "responses": side({64: (112.0, 0.062, 0.047)}),
        "grpc": side({64: (105.0, 0.058, 0.040)}),
        "grpc-stream": side({64: (104.0, 0.056, 0.038)}),
        "replica": side({1: (12.5, 1.5, 1.0), 64: (90.0, 0.050, 0.045)}),
    }
    vllm_responses = side({64: (120.0, 0.060, None)})
    return {
        "vllm": vllm,
        "vllm_responses": vllm_responses,
        "app": app,
        "ratios": ratios(vllm, app),
        "references": references({"chat": vllm, "responses": vllm_responses}, app),
    }


def test_each_ratio_compares_the_sides_its_target_names():
    found = a_run()["ratios"]
    assert found == pytest.approx(
        {
            "ttft_64": 1.1,
            "cpu_64": 1.2,
            "cpu_64_model": 0.9,
            "ttft_1_ms": 1.5,
            "stream_call_cpu": 0.038 / 0.040,
            "responses_ttft": 112 / 110,
            "responses_cpu": 0.062 / 0.060,
        }
    )
    assert set(found) == set(TARGETS)


def test_the_references_split_the_replica_from_the_route_and_vllms_responses_from_its_chat():
    found = a_run()["references"]
    assert found == pytest.approx(
        {"replica_ttft_64": 0.9, "replica_ttft_1_ms": 0.5, "vllm_responses_ttft": 1.2, "vllm_responses_cpu": 1.2}
    )
    assert set(found) == set(REFERENCES)


def test_the_table_has_a_column_per_run_and_says_whether_each_target_held_in_every_run():
    text = table(
        [a_run(), a_run(app_ttft_64=130.0)], {"date": "d", "machine": "m", "commit": "c", "command": "x", "config": "y"}
    )
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["first token p50 at 64 streams, app / vLLM"].endswith("| 1.10x | 1.30x | <= 1.1 | no |")
    assert rows["first token p50 at 1 stream, app - vLLM"].endswith("| +1.5 ms | +1.5 ms | <= +2 ms | yes |")
    assert rows["CPU s per 1k tokens at 64, whole app / vLLM"].endswith("| yes |")
    assert rows["first token p50 at 1 stream, at the model replica's own port - vLLM"].endswith("| +0.5 ms | +0.5 ms |")


def test_the_docs_table_is_replaced_between_its_markers_and_nothing_else(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Title\n\nbefore\n{TABLE_START}\nold table\n{TABLE_END}\nafter\n")
    write_docs(doc, "new table")
    assert doc.read_text() == f"# Title\n\nbefore\n{TABLE_START}\nnew table\n{TABLE_END}\nafter\n"
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(SystemExit):
        write_docs(tmp_path / "bare.md", "new table")
