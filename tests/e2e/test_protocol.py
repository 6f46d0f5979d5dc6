"""The OpenAI wire protocol on the real app: SSE framing, usage, routes, error shapes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml

from tests.e2e.harness.sse import post_stream
from tests.openai_errors import assert_openai_error


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        yield client


def chat(model: str, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "min_tokens": 8,
    } | extra


async def test_chat_stream_framing_and_usage_in_last_chunk(app, client):
    stream = await post_stream(
        client, "/v1/chat/completions", chat(app.model, stream=True, stream_options={"include_usage": True})
    )
    assert stream.status == 200
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.done and stream.events.count("[DONE]") == 1
    chunks = stream.chunks
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # Usage arrives once, in the last chunk, which has no choices.
    assert [("usage" in c and c["usage"] is not None) for c in chunks].count(True) == 1
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 8


async def test_chat_stream_without_usage_option_has_no_usage(app, client):
    stream = await post_stream(client, "/v1/chat/completions", chat(app.model, stream=True))
    assert stream.done
    assert all(c.get("usage") is None for c in stream.chunks)
    assert [c["finish_reason"] for ch in stream.chunks for c in ch["choices"] if c["finish_reason"]] == ["length"]


async def test_chat_unary(app, client):
    response = await client.post("/v1/chat/completions", json=chat(app.model))
    assert response.status_code == 200
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["model"] == app.model
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 8


async def test_completions_unary(app, client):
    body = {"model": app.model, "prompt": "Once upon a time", "max_tokens": 5, "min_tokens": 5}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5


async def test_completions_of_several_prompts_answer_up_to_the_sequences_a_request_may_start(app, client):
    """Two prompts with n 4 start 8 engine sequences, ingress.max_sequences_per_request: each is answered;
    one more prompt is a 400 naming ``prompt`` (the hostile table has the larger cases)."""
    body = {"model": app.model, "prompt": ["Once upon", "a time"], "n": 4, "max_tokens": 3, "min_tokens": 3}
    answer = (await client.post("/v1/completions", json=body)).json()
    assert sorted(c["index"] for c in answer["choices"]) == list(range(8))
    assert answer["usage"]["completion_tokens"] == 8 * 3
    over = await client.post("/v1/completions", json=body | {"prompt": ["Once upon", "a", "time"]})
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
    assert "12 sequences" in over.json()["error"]["message"] and "at most 8" in over.json()["error"]["message"]


async def test_completions_stream(app, client):
    body = {
        "model": app.model,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = await post_stream(client, "/v1/completions", body)
    assert stream.status == 200 and stream.done
    chunks = stream.chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == ["length"]


async def test_models(app, client):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    listing = response.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [app.model]


async def test_health(app, client):
    response = await client.get("/health")
    assert response.status_code == 200
    assert response.json()["models"] == {app.model: True}


async def test_unknown_model_is_404(app, client):
    error = assert_openai_error(await client.post("/v1/chat/completions", json=chat("gpt-4")), 404)
    assert error["param"] == "model"


async def test_malformed_json_is_400(app, client):
    response = await client.post(
        "/v1/chat/completions", content=b'{"model": "x", ', headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"messages": "hello"}, "messages"),
    ],
)
async def test_invalid_parameters_are_400_naming_them(app, client, extra, param):
    error = assert_openai_error(await client.post("/v1/chat/completions", json=chat(app.model, **extra)), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


async def test_prompt_over_the_context_is_400_with_both_numbers(app, client):
    long_prompt = "word " * 2000
    body = {"model": app.model, "prompt": long_prompt, "max_tokens": 10}
    error = assert_openai_error(await client.post("/v1/completions", json=body), 400)
    assert "1024" in error["message"]


async def test_server_still_answers_after_bad_requests(app, client):
    response = await client.post("/v1/chat/completions", json=chat(app.model))
    assert response.status_code == 200


async def test_seeded_prompts_past_one_steps_tokens_are_all_answered(app, client):
    """Six seeded requests at once whose prompts (790 tokens each) together pass what the
    engine computes in one step (vLLM's max_num_batched_tokens, 2,048 on CPU) are all answered.
    With chunked prefill, a step prefilled part of a prompt and vLLM rewound that seeded request's
    generator with a call CPU generators lack: the engine died with the six (seen in CI, under
    test_structured_outputs.py's seeded schemas). deploy/config.cpu.yaml prefills each prompt whole."""

    def seeded(i: int) -> dict:
        prompt = " ".join(f"item{i}-{n}" for n in range(100))  # distinct: no prefix-cache hit
        return {"model": app.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "seed": i}

    answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=seeded(i)) for i in range(6)))
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers if a.status_code != 200][:1]
    prompt_tokens = [a.json()["usage"]["prompt_tokens"] for a in answers]
    assert sum(prompt_tokens) > 2048 and max(prompt_tokens) < 1024, prompt_tokens


async def test_answer_length_is_bounded_by_the_models_ceiling(app, client):
    """deploy/config.cpu.yaml caps answers at 1000 tokens (vLLM's override_generation_config.max_new_tokens)."""
    config = yaml.safe_load(app.config_path.read_text())["applications"][0]["args"]["models"][0]
    ceiling = config["engine_args"]["override_generation_config"]["max_new_tokens"]
    over = await client.post("/v1/chat/completions", json=chat(app.model) | {"max_tokens": ceiling + 1})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert f"at most {ceiling} tokens" in over.json()["error"]["message"]
    # Without max_tokens: the ceiling, or what the 1024-token context leaves after the prompt.
    body = {"model": app.model, "messages": [{"role": "user", "content": "hello"}], "ignore_eos": True}
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    prompt = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == min(ceiling, 1024 - prompt)
    assert answer["choices"][0]["finish_reason"] == "length"
    many = await client.post("/v1/chat/completions", json=chat(app.model) | {"n": 9})
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
