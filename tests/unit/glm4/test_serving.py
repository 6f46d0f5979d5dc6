"""GLM-4 in vLLM's serving: the parser on vLLM's request objects, stop ids, dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from serve_app.config import ConfigError, parse_app_config
from serve_app.glm4 import serving as glm4_serving
from serve_app.glm4.format import (
    STOP_TOKENS,
    check_dtype,
    stop_token_ids,
)
from serve_app.glm4.parser import Glm4Parser, Glm4ToolParser
from tests.glm4_conversations import TIME_TOOL, WEATHER_TOOL

CALL = 'get_weather\n{"city": "Paris"}'


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="glm", messages=[{"role": "user", "content": "hi"}], **fields)


def with_tools(**fields) -> ChatCompletionRequest:
    return request(tools=[WEATHER_TOOL, TIME_TOOL], **fields)


def stream(parser: Glm4Parser, req: ChatCompletionRequest, pieces: list[str]) -> list:
    deltas = [parser.parse_delta(piece, [], req, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return [d for d in deltas if d is not None]


def test_auto_reads_a_glm4_call_unary() -> None:
    req = with_tools()
    reasoning, content, calls = Glm4Parser(None, req.tools).parse(CALL, req, enable_auto_tools=True)
    assert (reasoning, content) == (None, None)
    assert [(c.name, c.arguments) for c in calls or []] == [("get_weather", '{"city": "Paris"}')]


def test_auto_streams_a_call_as_one_openai_tool_call_delta() -> None:
    req = with_tools(stream=True)
    deltas = stream(Glm4Parser(None, req.tools), req, list(CALL))
    assert len(deltas) == 1
    (call,) = deltas[0].tool_calls
    assert (call.index, call.type, call.function.name) == (0, "function", "get_weather")
    assert call.id and call.function.arguments == '{"city": "Paris"}'
    assert deltas[0].content is None


def test_several_streamed_calls_get_consecutive_indexes_and_distinct_ids() -> None:
    req = with_tools(stream=True)
    text = CALL + '<|assistant|>get_time\n{"utc": true}'
    calls = [c for d in stream(Glm4Parser(None, req.tools), req, list(text)) for c in d.tool_calls]
    assert [c.index for c in calls] == [0, 1]
    assert len({c.id for c in calls}) == 2


def test_auto_text_streams_without_the_metadata_newline() -> None:
    req = with_tools(stream=True)
    deltas = stream(Glm4Parser(None, req.tools), req, ["\n", "Sun", "ny."])
    assert [d.content for d in deltas] == ["Sun", "ny."]


def test_malformed_call_comes_back_as_content_at_the_end_of_the_stream() -> None:
    req = with_tools(stream=True)
    broken = 'get_weather\n{"city": Par'
    deltas = stream(Glm4Parser(None, req.tools), req, [broken[:5], broken[5:]])
    assert [(d.content, d.tool_calls) for d in deltas] == [(broken, [])]


def test_special_tokens_kept_for_reading_calls_do_not_reach_the_text() -> None:
    req = with_tools(stream=True)
    text = "\nSee<|begin_of_image|> this.<|assistant|>" + CALL
    _, content, calls = Glm4Parser(None, req.tools).parse(text, req, enable_auto_tools=True)
    assert content == "See this." and calls is not None and len(calls) == 1
    deltas = stream(Glm4Parser(None, req.tools), req, ["\nSee<|", "begin_of_image|> this.<|assistant|>", CALL])
    assert "".join(d.content or "" for d in deltas) == "See this."


def test_without_tools_answers_are_text_even_if_they_look_like_calls() -> None:
    req = request()
    assert Glm4Parser(None, None).parse("\n" + CALL, req)[1:] == (CALL, [])
    deltas = stream(Glm4Parser(None, None), req, ["\nget", "_weather\n{}"])
    assert "".join(d.content for d in deltas) == "get_weather\n{}"


def test_tool_choice_none_gives_text() -> None:
    req = with_tools(tool_choice="none")
    assert Glm4Parser(None, req.tools).parse(CALL, req, enable_auto_tools=True)[1:] == (CALL, [])


def test_named_function_uses_vllms_schema_constrained_json() -> None:
    req = with_tools(tool_choice={"type": "function", "function": {"name": "get_time"}})
    adjusted = Glm4Parser(None, req.tools).adjust_request(req)
    assert adjusted.structured_outputs.json == TIME_TOOL["function"]["parameters"]
    _, content, calls = Glm4Parser(None, req.tools).parse('{"utc": true}', adjusted, enable_auto_tools=True)
    assert [(c.name, c.arguments) for c in calls or []] == [("get_time", '{"utc": true}')]


def test_required_uses_vllms_schema_of_all_tools() -> None:
    req = with_tools(tool_choice="required")
    adjusted = Glm4Parser(None, req.tools).adjust_request(req)
    assert adjusted.structured_outputs.json["minItems"] == 1
    output = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    _, _, calls = Glm4Parser(None, req.tools).parse(output, adjusted, enable_auto_tools=True)
    assert [(c.name, c.arguments) for c in calls or []] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ('[{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')]),
        (
            '[{"name": "get_time", "parameters": {"utc": true}}, {"name": "get_weather", "parameters": {"ci',
            [("get_time", '{"utc": true}'), ("get_weather", '{"ci')],
        ),
        ('[{"name": "get_wea', []),  # not even a name yet: nothing to call
    ],
)
def test_required_cut_short_returns_the_partial_calls_as_vllm_streams_them(output, expected) -> None:
    from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

    req = Glm4Parser(None, None).adjust_request(with_tools(tool_choice="required"))
    _, content, calls = Glm4Parser(None, req.tools).parse(output, req, enable_auto_tools=True)
    assert content is None and [(c.name, c.arguments) for c in calls or []] == expected
    streamed, _ = extract_required_tool_call_streaming(
        previous_text="", current_text=output, tool_call_idx=None, tool_call_id_type="random"
    )
    assert [(c.function.name, c.function.arguments) for c in (streamed.tool_calls if streamed else [])] == expected


def test_auto_keeps_the_turn_separator_in_the_text() -> None:
    assert Glm4Parser(None, None).adjust_request(with_tools()).skip_special_tokens is False
    assert Glm4Parser(None, None).adjust_request(request()).skip_special_tokens is True


def test_legacy_tool_parser_reads_whole_answers() -> None:
    req = with_tools()
    info = Glm4ToolParser(None, req.tools).extract_tool_calls(CALL, req)
    assert info.tools_called and info.tool_calls[0].function.name == "get_weather"


class Vocab:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def engine_with_generation_config(fields: dict) -> SimpleNamespace:
    return SimpleNamespace(input_processor=SimpleNamespace(generation_config_fields=fields))


def sampling_params(engine: SimpleNamespace, eos_token_id: int, **fields):
    """A request's sampling parameters as vLLM's input processor finishes them."""
    params = request(**fields).to_sampling_params(16, {})
    params.update_from_generation_config(engine.input_processor.generation_config_fields, eos_token_id)
    return params


@pytest.mark.parametrize("listed", [None, 151329, [151329], [151329, 151336, 151338]])
def test_the_three_stop_tokens_become_the_engines_eos_tokens(listed) -> None:
    engine = engine_with_generation_config({} if listed is None else {"eos_token_id": listed, "top_p": 0.8})
    glm4_serving.make_eos_tokens(engine, [151329, 151336, 151338])
    assert engine.input_processor.generation_config_fields["eos_token_id"] == [151329, 151336, 151338]
    assert listed is None or engine.input_processor.generation_config_fields["top_p"] == 0.8


def test_every_request_stops_on_the_three_unless_it_sets_ignore_eos() -> None:
    engine = engine_with_generation_config({"eos_token_id": 151329})
    glm4_serving.make_eos_tokens(engine, [151329, 151336, 151338])
    for fields in ({}, {"stop_token_ids": [7]}):
        params = sampling_params(engine, 151329, **fields)
        assert params.eos_token_id == 151329 and {151336, 151338} <= set(params.stop_token_ids), fields
    assert 7 in sampling_params(engine, 151329, stop_token_ids=[7]).stop_token_ids
    ignoring = sampling_params(engine, 151329, ignore_eos=True)
    assert ignoring.eos_token_id is None and not {151329, 151336, 151338} & set(ignoring.stop_token_ids)
    # min_tokens still holds back all three (vLLM's all_stop_token_ids)
    assert {151329, 151336, 151338} <= sampling_params(engine, 151329, min_tokens=4).all_stop_token_ids


def test_a_tokenizer_without_glm4_stop_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="<|observation|>"):
        stop_token_ids(Vocab({"<|endoftext|>": 0, "<|user|>": 1}))
    assert stop_token_ids(Vocab({t: i for i, t in enumerate(STOP_TOKENS)})) == [0, 1, 2]


@pytest.mark.parametrize("dtype", ["float16", "half", "fp16", torch.float16])
def test_half_precision_is_refused_with_the_reason(dtype) -> None:
    with pytest.raises(ValueError, match="NaN"):
        check_dtype(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "auto", "float32", torch.bfloat16])
def test_other_dtypes_pass(dtype) -> None:
    check_dtype(dtype)


def test_config_asking_for_fp16_fails_at_start_naming_the_field() -> None:
    args = {"models": [{"name": "glm", "engine_args": {"model": "m", "dtype": "half", "max_num_seqs": 8}}]}
    with pytest.raises(ConfigError, match=r"args\.models\.0\.engine_args: .*float16.*NaN"):
        parse_app_config(args)
