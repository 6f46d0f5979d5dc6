"""Conversations whose later turns should find their history in the prefix cache of the model
replica that served the turns before (test_prefix_routing, test_bare_serve_run).

Each conversation has its own system prompt of a few hundred tokens, so only the replica that
served its earlier turns holds any of its prompt: a later turn sent to the other replica would find
nothing cached. Whether a turn found its history cached is vLLM's own answer:
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio

import httpx

MODEL_NAME = "glm-4-9b-chat"
CONVERSATIONS = 8
TURNS = 4
ANSWER_TOKENS = 16


def system_prompt(n: int) -> str:
    """A system prompt of a few hundred tokens that no other conversation shares."""
    return f"Conversation {n}. " + " ".join(f"rule {n}-{i}: answer with care and brevity." for i in range(14))


async def converse(client: httpx.AsyncClient, n: int) -> list[dict[str, int]]:
    """One conversation of TURNS turns, each resending the history; each turn's usage."""
    messages = [{"role": "system", "content": system_prompt(n)}, {"role": "user", "content": "First question?"}]
    usages = []
    for turn in range(TURNS):
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": ANSWER_TOKENS, "min_tokens": ANSWER_TOKENS}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        usage = answer["usage"]
        usages.append({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]})
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Question number {turn + 2}?"},
        ]
    return usages


async def check_turns(client: httpx.AsyncClient) -> None:
    """Every later turn of every conversation finds at least half of its prompt cached."""
    conversations = await asyncio.gather(*(converse(client, n) for n in range(CONVERSATIONS)))
    for n, usages in enumerate(conversations):
        assert usages[0]["prompt"] > 250, usages  # several KV blocks of its own
        for before, turn in zip(usages, usages[1:], strict=False):
            # The replica that served the turn before holds it: at least half of it is cached.
            assert turn["cached"] >= before["prompt"] // 2, (n, usages)
    later = [turn for usages in conversations for turn in usages[1:]]
    hit_rate = sum(t["cached"] for t in later) / sum(t["prompt"] for t in later)
    print(f"{CONVERSATIONS} conversations x {TURNS} turns: turns >= 2 had {hit_rate:.0%} of their prompt cached")
