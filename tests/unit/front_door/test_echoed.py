"""What a client names and the server echoes or keeps is bounded (issue 78): ids, positions in a
log, a Responses body's metadata and labels, each a 400 naming the parameter past its bound."""

from __future__ import annotations

import pytest

from serve_app.errors import APIError
from serve_app.front_door.admission.echoed import MAX_ID_CHARS, MAX_POSITION, checked_id, checked_position
from serve_app.front_door.admission.responses_rules import check_served


def test_an_id_is_at_most_its_bound_and_its_refusal_does_not_quote_it():
    assert checked_id("resp_" + "0" * 32, "response_id") == "resp_" + "0" * 32
    assert checked_id("x" * MAX_ID_CHARS, "answer_id") == "x" * MAX_ID_CHARS
    with pytest.raises(APIError) as refused:
        checked_id("x" * 5_000, "answer_id")
    assert (refused.value.status, refused.value.param) == (400, "answer_id") and "xxx" not in refused.value.message


@pytest.mark.parametrize("position", [-2, MAX_POSITION, 2**64])
def test_a_position_a_log_cannot_hold_is_400(position):
    with pytest.raises(APIError) as refused:
        checked_position(position, "after_index")
    assert (refused.value.status, refused.value.param) == (400, "after_index")


@pytest.mark.parametrize("position", [-1, 0, MAX_POSITION - 1])
def test_a_position_a_log_can_hold_passes(position):
    assert checked_position(position, "starting_after") == position


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"metadata": {f"k{n}": "v" for n in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"user": "u" * 513}, "user"),
        ({"safety_identifier": "s" * 513}, "safety_identifier"),
        ({"prompt_cache_key": "p" * 513}, "prompt_cache_key"),
        ({"previous_response_id": "resp_" + "0" * 200}, "previous_response_id"),
    ],
)
def test_a_responses_body_that_would_echo_a_string_past_its_bound_is_400_naming_it(extra, param):
    with pytest.raises(APIError) as refused:
        check_served({"model": "m", "input": "hi"} | extra)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_responses_body_within_the_bounds_passes():
    check_served(
        {
            "model": "m",
            "input": "hi",
            "metadata": {f"k{n}": "v" * 512 for n in range(16)},
            "user": "u" * 512,
            "previous_response_id": "resp_" + "0" * 32,
        }
    )
