"""The grammar backend the app decodes JSON schemas with, and the one it refuses.

vLLM's own backend classes, configured as the serve configs configure the engine and with
the app's vLLM plugin in effect (``benchmarks/grammar_cost.py``'s ``backend`` and ``walk``,
which the grammar-cost benchmark times), compile each schema of ``tests/json_schemas.py`` for the tiny
model's tokenizer (every byte is a token, so any string can be written), and seeded
random walks take any token the grammar allows until it lets the answer end: with the
backend the app runs, every finished walk is strict JSON that satisfies its schema.
A random walk is the worst a model can do under the grammar; the end-to-end test
(tests/e2e/test_structured_outputs.py) decodes with the real engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.grammar_cost import allowed_tokens, backend, walk
from serve_app.config import ModelConfig
from serve_app.config.structured_outputs import GRAMMAR_BACKEND
from serve_app.glm4.format import SPECIAL_TOKENS
from tests.json_schemas import SCHEMAS, UNENFORCEABLE, parse_and_check

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm4"
WALKS = 40  # per schema
LONGEST_WALK = 300  # tokens; a walk still going then is an answer cut by max_tokens


@pytest.fixture(scope="module")
def tokenizer():
    if not (TINY_MODEL / "tokenizer.json").exists():
        pytest.fail(f"{TINY_MODEL} is missing: run `make tiny-model`")
    return AutoTokenizer.from_pretrained(str(TINY_MODEL))


@pytest.mark.parametrize("name", [*SCHEMAS, "json_object"])
def test_every_answer_the_grammar_lets_end_is_json_that_satisfies_its_schema(tokenizer, name):
    schema = SCHEMAS.get(name)
    guidance = backend(GRAMMAR_BACKEND, tokenizer)
    finished = 0
    for seed in range(WALKS):
        done = walk(guidance, schema, seed, tokenizer.eos_token_id, LONGEST_WALK)
        if not done.ended:
            continue
        finished += 1
        text = tokenizer.decode(done.tokens)
        try:
            parse_and_check(text, schema or {"type": "object"})
        except ValueError as error:  # json's and jsonschema's errors both are
            pytest.fail(f"seed {seed}: {text!r} is not a valid answer: {error}")
    assert finished >= WALKS // 2, f"only {finished} of {WALKS} walks ended within {LONGEST_WALK} tokens"


def test_xgrammar_still_lets_raw_control_characters_into_length_bounded_strings(tokenizer):
    """Why the app refuses xgrammar (serve_app/config/structured_outputs.py). When this fails, the installed
    xgrammar keeps such strings valid JSON, and the refusal can be revisited."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    xgrammar = backend("xgrammar", tokenizer)
    grammar = xgrammar.compile_grammar(StructuredOutputOptions.JSON, json.dumps(SCHEMAS["profile"]))
    answer = '{"name":"a\tb\x01","bio":"c"}'  # raw TAB and U+0001: RFC 8259 allows neither in a string
    accepted = grammar.matcher.accept_string(answer) and grammar.accept_tokens("r", [tokenizer.eos_token_id])
    accepted = accepted and grammar.is_terminated()  # the answer may end there
    assert accepted, "xgrammar now refuses raw control characters in length-bounded strings"
    with pytest.raises(ValueError, match="Invalid control character"):
        json.loads(answer)


def forced_walk(backend, kind, spec: str, eos: int) -> list[int]:
    """The tokens of the one answer ``spec`` allows, each the first token the mask allows."""
    grammar = backend.compile_grammar(kind, spec)
    bitmask = backend.allocate_token_bitmask(1)
    tokens: list[int] = []
    while not grammar.is_terminated() and len(tokens) < LONGEST_WALK:
        grammar.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, backend.vocab_size)
        if allowed[0] == eos:
            break
        assert grammar.accept_tokens("forced", [int(allowed[0])]), grammar.ll_matcher.get_error()
        tokens.append(int(allowed[0]))
    return tokens


def test_text_a_grammar_forces_stays_text_when_it_spells_a_control_token(tokenizer):
    """Without the app's plugin, llguidance's mask allows the control token ``<|observation|>`` where
    the grammar forces that text, accepting it fails, and vLLM ends the request with a 500."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    guidance = backend(GRAMMAR_BACKEND, tokenizer)
    control = set(tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS))
    const = {"type": "object", "properties": {"v": {"const": "<|user|> hi"}}, "required": ["v"]}
    for kind, spec, text in (
        (StructuredOutputOptions.REGEX, r"<\|observation\|> ok", "<|observation|> ok"),
        (StructuredOutputOptions.JSON, json.dumps(const), '{"v":"<|user|> hi"}'),
    ):
        tokens = forced_walk(guidance, kind, spec, tokenizer.eos_token_id)
        assert tokenizer.decode(tokens) == text and not control & set(tokens), tokens
    # A Lark grammar still writes a control token, named by its id.
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    tokens = forced_walk(
        guidance, StructuredOutputOptions.GRAMMAR, f'start: "a" <[{assistant}]> "b"', tokenizer.eos_token_id
    )
    assert tokenizer.convert_ids_to_tokens(tokens) == ["a", "<|assistant|>", "b"]


def test_llguidance_still_reads_control_token_text_as_the_control_token(tokenizer):
    """Why the app's plugin gives llguidance a tokenizer of its own (vllm_internals.llguidance_tokenizer).
    When this fails, llguidance keeps forced text as text by itself, and the plugin can go."""
    import llguidance.hf

    observation = tokenizer.convert_tokens_to_ids("<|observation|>")
    as_vllm_builds_it = llguidance.hf.from_tokenizer(tokenizer, len(tokenizer))
    assert as_vllm_builds_it.tokenize_bytes(b"<|observation|>", parse_special=False) == [observation]


@pytest.mark.parametrize("keyword", UNENFORCEABLE)
def test_a_keyword_the_grammar_cannot_enforce_is_refused_naming_it(tokenizer, keyword):
    """vLLM's validation for the guidance backend (it answers 400 with this message)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar

    guidance = backend(GRAMMAR_BACKEND, tokenizer)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=UNENFORCEABLE[keyword]))
    expected = "color" if keyword == "format" else keyword
    with pytest.raises(VLLMValidationError, match=expected):
        validate_guidance_grammar(params, tokenizer=guidance.ll_tokenizer)


def _model(**engine_args) -> ModelConfig:
    return ModelConfig(name="m", engine_args={"model": "m", "max_num_seqs": 4, **engine_args})


def test_the_app_decodes_schemas_with_guidance_and_refuses_any_other_backend():
    assert _model().engine_args["structured_outputs_config"] == {
        "backend": "guidance",
        "disable_additional_properties": True,
    }
    chosen = {"backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": False}
    assert _model(structured_outputs_config=chosen).engine_args["structured_outputs_config"] == chosen
    for other in ("xgrammar", "auto", "outlines", "lm-format-enforcer"):
        with pytest.raises(ValueError, match=f"backend '{other}' refused: only 'guidance'"):
            _model(structured_outputs_config={"backend": other})
