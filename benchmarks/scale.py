"""A load ramp through autoscaling: users 0 -> peak -> 0, replicas and latency over time, every outcome counted.

    make serve CONFIG=deploy/config.sim.yaml        # in another terminal
    python -m benchmarks.scale --model glm-4-9b-chat --peak 512 --out-dir bench/scale

Virtual users follow a ramp (up over ``--up-s``, held ``--hold-s``, down over ``--down-s``);
each sends a streamed request, waits for the whole answer, thinks for an exponential time
(``--think-s`` mean) and sends again, so arrivals are Poisson-like and the load stays bounded
by the users. Lengths vary per request (prompts of 16-256 tokens, answers of 32-512). After
the ramp it watches ``--tail-s`` more, for the replicas to go back down.

Every ``--sample-s`` it reads the model deployment's replicas from Serve's REST API (the
dashboard, with the Ray token of ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and each
replica's ongoing requests and the routers' queued ones from Ray's metrics endpoint; per
window it records users, requests in flight, completions, tokens/s and TTFT p50/p99. Every
request ends counted: complete (every token), refused fast (429), or failed (anything else,
named). Prints progress and a summary, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.client import carries_tokens, sse_payloads


@dataclass
class Outcome:
    started_s: float
    status: str  # "complete", "429", or what failed
    ttft_s: float | None = None
    ended_s: float = 0.0
    tokens: int = 0


@dataclass
class Sample:
    at_s: float
    users: int
    in_flight: int
    replicas: dict[str, int] = field(default_factory=dict)  # Serve's replica states: count
    ongoing: dict[str, float] = field(default_factory=dict)  # per running replica (metrics)
    queued: float = 0.0  # waiting in the routers (metrics)


def users_at(t: float, peak: int, up_s: float, hold_s: float, down_s: float) -> int:
    """The ramp: 0 -> peak over up_s, held, back to 0 over down_s."""
    if t < up_s:
        return round(peak * t / up_s)
    if t < up_s + hold_s:
        return peak
    if t < up_s + hold_s + down_s:
        return round(peak * (1 - (t - up_s - hold_s) / down_s))
    return 0


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.outcomes: list[Outcome] = []
        self.samples: list[Sample] = []
        self.in_flight = 0
        self.users = 0
        self.started = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.started

    async def user(self, index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(self.args.seed * 100_003 + index)
        while index < self.users:
            await self.request(client, rng)
            await asyncio.sleep(rng.expovariate(1 / self.args.think_s))

    async def request(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        prompt, answer = rng.randint(16, 256), rng.randint(32, 512)
        body = {
            "model": self.args.model,
            "prompt": [100 + i % 200 for i in range(prompt)],
            "max_tokens": answer,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        outcome = Outcome(self.now(), "incomplete")
        self.outcomes.append(outcome)
        self.in_flight += 1
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    outcome.status = str(response.status_code)
                    return
                async for payload in sse_payloads(response):
                    if payload == "[DONE]":
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        outcome.status = f"error event {event['error'].get('code')}"
                        return
                    if outcome.ttft_s is None and carries_tokens(event):
                        outcome.ttft_s = self.now() - outcome.started_s
                    if event.get("usage"):
                        outcome.tokens = event["usage"]["completion_tokens"]
                outcome.status = "complete" if outcome.tokens == answer else f"{outcome.tokens} of {answer} tokens"
        except httpx.HTTPError as exc:
            outcome.status = type(exc).__name__
        finally:
            outcome.ended_s = self.now()
            self.in_flight -= 1

    async def drive(self) -> None:
        args = self.args
        limits = httpx.Limits(max_connections=args.peak + 16, max_keepalive_connections=args.peak + 16)
        async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s, limits=limits) as client:
            tasks: dict[int, asyncio.Task[None]] = {}
            ramp_s = args.up_s + args.hold_s + args.down_s
            while self.now() < ramp_s:
                self.users = users_at(self.now(), args.peak, args.up_s, args.hold_s, args.down_s)
                for index in range(self.users):
                    if index not in tasks or tasks[index].done():
                        tasks[index] = asyncio.create_task(self.user(index, client))
                await asyncio.sleep(0.25)  # how often the number of users follows the ramp
            self.users = 0
            await asyncio.gather(*tasks.values())

    async def watch(self, until_s: float) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while self.now() < until_s:
                sample = Sample(self.now(), self.users, self.in_flight)
                try:
                    sample.replicas = await replica_states(client, self.args)
                    sample.ongoing, sample.queued = await load_metrics(client, self.args)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    print(f"\nsample at {sample.at_s:.0f} s: {exc!r}", file=sys.stderr)
                self.samples.append(sample)
                done = sum(1 for o in self.outcomes if o.status != "incomplete")
                sys.stderr.write(
                    f"\r{sample.at_s:6.0f} s  users {sample.users:4d}  in flight {sample.in_flight:4d}  "
                    f"replicas {sample.replicas}  queued {sample.queued:5.0f}  ended {done}   "
                )
                sys.stderr.flush()
                await asyncio.sleep(self.args.sample_s)
        sys.stderr.write("\n")


def ray_token() -> str:
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    return path.read_text().strip()


async def replica_states(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, int]:
    """The model deployment's replicas by state, from Serve's REST API."""
    headers = {"Authorization": f"Bearer {ray_token()}"}
    body = (await client.get(f"{args.dashboard}/api/serve/applications/", headers=headers)).json()
    states: dict[str, int] = {}
    for application in body["applications"].values():
        deployment = application["deployments"].get(args.deployment)
        for replica in (deployment or {}).get("replicas", []):
            states[replica["state"]] = states.get(replica["state"], 0) + 1
    return states


async def load_metrics(client: httpx.AsyncClient, args: argparse.Namespace) -> tuple[dict[str, float], float]:
    """Each replica's ongoing requests and the requests queued in routers, from Ray's metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    ongoing: dict[str, float] = {}
    queued = 0.0
    text = (await client.get(args.metrics_url)).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("deployment") != args.deployment:
                continue
            if sample.name == "ray_serve_replica_processing_queries":
                ongoing[sample.labels["replica"]] = sample.value
            elif sample.name == "ray_serve_deployment_queued_queries":
                queued += sample.value
    return ongoing, queued


def windows(outcomes: list[Outcome], end_s: float, width_s: float) -> list[dict[str, Any]]:
    """Per window of ended requests: completions, tokens/s, TTFT p50/p99 (ms), refusals, failures."""
    rows = []
    for start in np.arange(0.0, end_s, width_s):
        ended = [o for o in outcomes if start <= o.ended_s < start + width_s]
        ttfts = [1000 * o.ttft_s for o in ended if o.status == "complete" and o.ttft_s is not None]
        rows.append(
            {
                "start_s": float(start),
                "complete": sum(o.status == "complete" for o in ended),
                "refused_429": sum(o.status == "429" for o in ended),
                "failed": sum(o.status not in ("complete", "429") for o in ended),
                "tokens_per_s": sum(o.tokens for o in ended if o.status == "complete") / width_s,
                "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
                "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
            }
        )
    return rows


def flapping(samples: list[Sample], downscale_delay_s: float) -> list[tuple[float, float]]:
    """(added at, removed at) for each replica removed within one downscale delay of an addition."""
    events: list[tuple[float, float]] = []
    last_up: float | None = None
    previous = None
    for sample in samples:
        count = sample.replicas.get("RUNNING", 0) + sample.replicas.get("STARTING", 0)
        if previous is not None and count > previous:
            last_up = sample.at_s
        if (
            previous is not None
            and count < previous
            and last_up is not None
            and sample.at_s - last_up < downscale_delay_s
        ):
            events.append((last_up, sample.at_s))
        previous = count
    return events


def summary(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for outcome in run.outcomes:
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
    refused = [o.ended_s - o.started_s for o in run.outcomes if o.status == "429"]
    running = [s.replicas.get("RUNNING", 0) for s in run.samples]
    return {
        "requests": len(run.outcomes),
        "outcomes": statuses,
        "lost": statuses.get("incomplete", 0),
        "refusal_p99_ms": float(np.percentile(refused, 99)) * 1000 if refused else None,
        "replicas_max": max(running, default=0),
        "replicas_at_end": running[-1] if running else None,
        "flapping": flapping(run.samples, args.downscale_delay_s),
    }


def plot(run: Run, rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (load, replicas, latency, throughput) = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    t = [s.at_s for s in run.samples]
    load.plot(t, [s.users for s in run.samples], label="users")
    load.plot(t, [s.in_flight for s in run.samples], label="requests in flight (client)")
    load.plot(t, [s.queued for s in run.samples], label="queued in Serve's routers")
    load.set(ylabel="requests", title="load")
    replicas.step(t, [s.replicas.get("RUNNING", 0) for s in run.samples], where="post", label="running replicas")
    replicas.step(t, [s.replicas.get("STARTING", 0) for s in run.samples], where="post", label="starting")
    replicas.plot(t, [max(s.ongoing.values(), default=0) for s in run.samples], ":", label="ongoing, busiest replica")
    replicas.plot(
        t,
        [np.mean(list(s.ongoing.values())) if s.ongoing else 0 for s in run.samples],
        ":",
        label="ongoing, replica mean",
    )
    replicas.set(title="model replicas")
    starts = [r["start_s"] for r in rows]
    latency.plot(starts, [r["ttft_p50_ms"] for r in rows], "o-", label="TTFT p50")
    latency.plot(starts, [r["ttft_p99_ms"] for r in rows], "s-", label="TTFT p99")
    latency.set(ylabel="ms", yscale="log", title="time to first token (requests ending in the window)")
    throughput.plot(starts, [r["tokens_per_s"] for r in rows], "o-", label="delivered tokens/s")
    throughput.plot(starts, [r["refused_429"] for r in rows], "x", label="429s in the window")
    throughput.set(xlabel="seconds", title="throughput")
    for axis in (load, replicas, latency, throughput):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    run = Run(args)
    end_s = args.up_s + args.hold_s + args.down_s + args.tail_s
    await asyncio.gather(run.drive(), run.watch(end_s))
    rows = windows(run.outcomes, end_s, args.window_s)
    result = {
        "settings": vars(args) | {"out_dir": str(args.out_dir)},
        "summary": summary(run, args),
        "windows": rows,
        "samples": [asdict(s) for s in run.samples],
        "requests": [asdict(o) for o in run.outcomes],
    }
    print(json.dumps(result["summary"], indent=1))
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "scale.json").write_text(json.dumps(result, indent=1))
        plot(run, rows, args.out_dir / "scale.png")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--deployment", default="model-glm-4-9b-chat", help="the model's Serve deployment")
    parser.add_argument("--dashboard", default="http://127.0.0.1:8265", help="Ray's dashboard (Serve's REST API)")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics", help="Ray's Prometheus endpoint")
    parser.add_argument("--peak", type=int, default=512, help="users at the top of the ramp")
    parser.add_argument("--up-s", type=float, default=180)
    parser.add_argument("--hold-s", type=float, default=60)
    parser.add_argument("--down-s", type=float, default=180)
    parser.add_argument("--tail-s", type=float, default=180, help="watching after the ramp, for the scale-down")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean pause of a user between requests")
    parser.add_argument("--downscale-delay-s", type=float, default=60, help="the config's, to find flapping")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
