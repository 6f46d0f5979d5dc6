"""Each API key's prompts cached apart: another key's identical prompt finds nothing of them cached.

On ``glm-keyed`` (two API keys, each one's prompts cached apart as the shipped configs do by
default: ``ingress.prefix_cache_per_key``), key A's repeat of its own chat finds its prompt
cached (vLLM's own answer, ``usage.prompt_tokens_details.cached_tokens``), and key B's identical
chat finds nothing: B cannot tell what A asked. On ``glm-limited`` (the same keys, set to trust
each other: ``prefix_cache_per_key: false``), B's identical chat hits A's cache, as it did for
every key before. Each application runs one model replica, so no routing choice stands between
the two requests.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.harness.apps import FLOOD_KEY, LIGHT_KEY, RunningApp
from tests.e2e.harness.simulation import ready_bed

pytestmark = pytest.mark.applications("glm-keyed", "glm-limited")

KEY_A, KEY_B = FLOOD_KEY, LIGHT_KEY


def secret_chat(model: str) -> dict:
    """A chat whose system prompt (about 2,800 characters, as a tenant's instructions or document)
    no earlier request sent."""
    secret = f"{uuid.uuid4()}: tenant A's instructions. " + " ".join(f"clause {i}: keep it private." for i in range(90))
    messages = [{"role": "system", "content": secret}, {"role": "user", "content": "Summarise the clauses."}]
    return {"model": model, "messages": messages, "max_tokens": 1}


async def cached_tokens(app: RunningApp, key: str, body: dict) -> int:
    async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
        response = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_another_keys_identical_prompt_finds_none_of_it_cached(variants):
    app = (await ready_bed(variants["glm-keyed"])).app
    body = secret_chat(app.model)
    assert await cached_tokens(app, KEY_A, body) == 0
    own_repeat = await cached_tokens(app, KEY_A, body)
    assert own_repeat > 500, own_repeat  # A's own prompt is cached for A
    assert await cached_tokens(app, KEY_B, body) == 0
    assert await cached_tokens(app, KEY_A, body) == own_repeat  # and B's request left A's cache as it was


async def test_where_the_keys_trust_each_other_they_share_the_cache(variants):
    app = (await ready_bed(variants["glm-limited"])).app
    body = secret_chat(app.model)
    assert await cached_tokens(app, KEY_A, body) == 0
    assert await cached_tokens(app, KEY_B, body) > 500
