"""deploy/cluster.env's reader: what it accepts and what it refuses."""

from __future__ import annotations

import pytest

from tools.cluster_env import cluster_env, parse


def test_names_and_values_without_comments_or_blank_lines():
    assert parse("# a comment\n\nA=1\n  B_2=x.y  \n") == {"A": "1", "B_2": "x.y"}


@pytest.mark.parametrize("line", ["NO_EQUALS", "1BAD=1", "A=two words", "A B=1"])
def test_a_line_that_is_not_name_equals_value_is_refused_with_its_number(line):
    with pytest.raises(ValueError, match="line 2"):
        parse(f"OK=1\n{line}\n")


def test_the_shipped_file_turns_on_haproxy_and_keeps_request_logs_unbuffered():
    env = cluster_env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"] == "1"
    assert env["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0"  # see deploy/cluster.env
