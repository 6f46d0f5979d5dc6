"""tools/suite_durations.py: pytest's durations report summed per module."""

from __future__ import annotations

from tools.suite_durations import module_seconds, table

REPORT = """
============================== slowest durations ===============================
172.23s setup    tests/e2e/test_concurrency.py::test_concurrent_streams_each_deliver_every_token
19.81s call     tests/e2e/test_concurrency.py::test_concurrent_streams_each_deliver_every_token
133.52s call     tests/e2e/test_autoscale.py::test_scales_out_under_load[a b]
63.34s teardown tests/e2e/test_autoscale.py::test_scales_out_under_load[a b]
7.37s call     tests/e2e/test_concurrency.py::test_concurrent_unary_requests_each_complete
"""


def test_each_modules_phases_are_summed_and_the_slowest_module_comes_first():
    seconds = module_seconds(REPORT)
    assert seconds["tests/e2e/test_concurrency.py"] == {"setup": 172.23, "call": 19.81 + 7.37, "teardown": 0.0}
    assert seconds["tests/e2e/test_autoscale.py"] == {"setup": 0.0, "call": 133.52, "teardown": 63.34}
    lines = table(seconds).splitlines()
    assert lines[2].startswith("| `tests/e2e/test_concurrency.py` | 172 | 27 | 0 | 199 |")
    assert lines[-1] == "| all | 172 | 161 | 63 | 396 |"
