"""Multi-turn chats against a running app: how much of each prompt the replicas' prefix caches hold.

    python -m benchmarks.multi_turn --model glm-4-9b-chat --conversations 8 --turns 4 \\
        --own-system-chars 400 --out multi-turn.json

C conversations run at once, T turns each; each turn resends the history (the system
prompt, every question and answer) plus a new question, as a chat client does. Every
conversation may start with a shared system prompt of ``--shared-system-tokens`` words and
one of its own of ``--own-system-chars`` characters; ``--hot`` sends every conversation the
same messages (one hot prefix). Turn k of every conversation is sent before turn k+1 of any,
so vLLM's own counters, read from Ray's metrics endpoint between rounds, separate turn 1 from
the later turns.

Reported: vLLM's prefix-cache hit rate (``prefix_cache_hits`` / ``prefix_cache_queries``) of
turn 1 and of turns >= 2, the same from each answer's ``cached_tokens``, the most turns >= 2
could find cached (each previous prompt in whole KV blocks of vLLM's ``block_size``: 128 on CPU,
16 on GPUs), TTFT p50/p99 of turns >= 2, and requests per model replica (vLLM's
``request_success`` by replica) with the busiest replica's share against the mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

HITS = "ray_vllm_prefix_cache_hits_total"  # vLLM's counters, as Ray exports them
QUERIES = "ray_vllm_prefix_cache_queries_total"
SUCCESS = "ray_vllm_request_success_total"
COUNTED = (HITS, QUERIES, SUCCESS)
CACHE_CONFIG = "ray_vllm_cache_config_info"  # its block_size label: the prefix cache's unit


async def engine_counters(client: httpx.AsyncClient, metrics_url: str, model: str) -> dict[str, dict[str, float]]:
    """vLLM's prefix-cache and finished-request counters of ``model``, per model replica, and
    its KV block size (as ``block_size`` of replica "")."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    text = (await client.get(metrics_url)).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG:  # (the same for every replica of the one model served)
                counters[""]["block_size"] = float(sample.labels["block_size"])
            elif sample.name in COUNTED and sample.labels.get("model_name") == model:
                counters[sample.labels.get("ReplicaId", "")][sample.name] += sample.value
    return counters


def change(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    return {replica: values[name] - before.get(replica, {}).get(name, 0.0) for replica, values in after.items()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_turn(client: httpx.AsyncClient, model: str, messages: list[dict], answer_tokens: int) -> dict[str, Any]:
    """Stream one turn; its TTFT, answer text and usage (cached tokens included)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": answer_tokens,
        "min_tokens": answer_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "answer": "".join(text),
        "prompt": usage["prompt_tokens"],
        "cached": details.get("cached_tokens", 0),
    }


def opening(n: int, args: argparse.Namespace) -> list[dict]:
    """Conversation ``n``'s system prompt(s) and first question."""
    who = 0 if args.hot else n
    shared = " ".join(f"policy{i % 97}" for i in range(args.shared_system_tokens))
    own = f"Run {args.run}, conversation {who}. " + "".join(f"Rule {who}.{i}: be brief. " for i in range(1000))
    system = " ".join(part for part in (shared, own[: args.own_system_chars]) if part)
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": f"Question 1 of conversation {who}?"}]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=300, limits=limits) as client:
        conversations = [opening(n, args) for n in range(args.conversations)]
        rounds = []
        for turn in range(args.turns):
            before = await engine_counters(client, args.metrics_url, args.model)
            results = await asyncio.gather(
                *(one_turn(client, args.model, messages, args.answer_tokens) for messages in conversations)
            )
            await asyncio.sleep(args.scrape_wait_s)  # Ray exports engine metrics every few seconds
            after = await engine_counters(client, args.metrics_url, args.model)
            rounds.append({"turn": turn + 1, "results": results, "before": before, "after": after})
            sys.stderr.write(f"turn {turn + 1}/{args.turns} done\n")
            for n, (messages, result) in enumerate(zip(conversations, results, strict=True)):
                who = 0 if args.hot else n
                messages += [
                    {"role": "assistant", "content": result["answer"]},
                    {"role": "user", "content": f"Question {turn + 2} of conversation {who}?"},
                ]
    return summarize(rounds, args)


def summarize(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def vllm_rate(selected: list[dict[str, Any]]) -> float:
        hits = sum(sum(change(r["before"], r["after"], HITS).values()) for r in selected)
        queries = sum(sum(change(r["before"], r["after"], QUERIES).values()) for r in selected)
        return hits / queries if queries else float("nan")

    later = [result for r in rounds[1:] for result in r["results"]]
    # The most a turn can find cached: the previous turn's prompt in whole KV blocks (the new
    # answer and question are not cached anywhere yet).
    block = int(rounds[-1]["after"].get("", {}).get("block_size", 1))
    ceiling = sum(
        previous["prompt"] // block * block
        for before, after in zip(rounds, rounds[1:], strict=False)
        for previous in before["results"]
    ) / max(1, sum(r["prompt"] for r in later))
    for r in rounds:
        for counters in (r["before"], r["after"]):
            counters.pop("", None)
    per_replica: dict[str, float] = defaultdict(float)
    for r in rounds:
        for replica, count in change(r["before"], r["after"], SUCCESS).items():
            per_replica[replica] += count
    # Replicas that served nothing count too (Ray keeps exporting replicas that are gone).
    per_replica = {replica: count for replica, count in per_replica.items() if count > 0}
    counts = list(per_replica.values()) + [0.0] * max(0, args.replicas - len(per_replica))
    ttfts = [1000 * r["ttft_s"] for r in later if r["ttft_s"] is not None]
    return {
        "conversations": args.conversations,
        "turns": args.turns,
        "shared_system_tokens": args.shared_system_tokens,
        "own_system_chars": args.own_system_chars,
        "hot": args.hot,
        "hit_rate_turn_1": vllm_rate(rounds[:1]),
        "hit_rate_later_turns": vllm_rate(rounds[1:]),
        "hit_rate_all_turns": vllm_rate(rounds),
        "cached_share_later_turns": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
        "block_size": block,
        "ceiling_later_turns": ceiling,
        "prompt_tokens_mean_later_turns": statistics.mean(r["prompt"] for r in later) if later else 0,
        "ttft_ms_later_turns": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
        "requests_per_replica": dict(per_replica),
        "busiest_over_mean": max(counts) / statistics.mean(counts) if counts else float("nan"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="glm-4-9b-chat")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics", help="Ray's Prometheus endpoint")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--shared-system-tokens", type=int, default=0, help="words of a system prompt all share")
    parser.add_argument("--own-system-chars", type=int, default=400, help="characters of each one's own system prompt")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument(
        "--run", default=secrets.token_hex(4), help="named in every own system prompt: a new run finds nothing cached"
    )
    parser.add_argument("--hot", action="store_true", help="every conversation sends the same messages")
    parser.add_argument(
        "--scrape-wait-s", type=float, default=12.0, help="wait for Ray's metrics export before reading"
    )
    parser.add_argument(
        "--replicas", type=int, default=0, help="model replicas serving (those that served nothing count as 0)"
    )
    parser.add_argument("--out", type=Path, help="write the summary as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
