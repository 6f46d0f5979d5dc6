"""The suite's Prometheus text parser (tests/e2e/harness/telemetry.py) reads what prometheus_client's does."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness.telemetry import parse_samples

PAGE = r"""# HELP ray_glm4_serve_requests_total Requests answered.
# TYPE ray_glm4_serve_requests_total counter
ray_glm4_serve_requests_total{application="glm-sim",endpoint="chat",status="200"} 12.0
ray_glm4_serve_requests_total{application="glm",endpoint="chat",status="429"} 3.0 1700000000000
# TYPE ray_vllm_iteration_tokens histogram
ray_vllm_iteration_tokens_bucket{ReplicaId="a1",le="32.0"} 5.0
ray_vllm_iteration_tokens_bucket{ReplicaId="a1",le="+Inf"} 9.0
ray_vllm_iteration_tokens_sum{ReplicaId="a1"} 301.5
ray_vllm_iteration_tokens_count{ReplicaId="a1"} 9.0
# TYPE ray_vllm_prefix_cache_hit_rate gauge
ray_vllm_prefix_cache_hit_rate{ReplicaId="b2"} NaN
ray_odd_labels{path="/v1/{id}",quote="say \"hi\", then \\ leave",line="a\nb",empty=""} -1e-3
ray_no_labels 7
ray_no_labels_braces{} +Inf
"""


def test_the_suites_parser_reads_every_sample_as_prometheus_client_does():
    expected = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(PAGE)
        for sample in family.samples
    }
    parsed = parse_samples(PAGE)
    assert parsed.keys() == expected.keys()
    assert {key: repr(value) for key, value in parsed.items()} == {key: repr(float(v)) for key, v in expected.items()}
    assert len(parsed) == 10  # every sample line
