"""How long a model replica's event loop stalls while its checker process starts.

A model replica checks large bodies and builds grammars in a process of its own
(:class:`serve_app.front_door.admission.large_bodies.BodyChecker`), started with the first of them
through Python's forkserver, which first imports vLLM's request models and grammar backend.
Every stream of the replica is written from its event loop, so a loop that waits for that
start stalls all of them. This runs, in a fresh process (no forkserver yet, as in a new
replica), a ticker on the event loop every ``--tick-ms`` while the checker starts and checks
one large body, and reports the longest gap between two ticks (what a stream would have
waited) and how long the first answer took.

    python -m benchmarks.checker_start
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from serve_app.front_door.admission.large_bodies import BodyChecker

# A valid chat made large (300 KB, over the 256 KiB that sends a body to the checker) by its text.
LARGE_BODY = json.dumps({"model": "glm-4-9b-chat", "messages": [{"role": "user", "content": "hi " * 100_000}]}).encode()


async def measure(tick_s: float) -> dict[str, float]:
    """The longest gap between ticks while the checker starts and answers, and that answer's time."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    longest, last, done = 0.0, time.monotonic(), asyncio.Event()

    async def tick() -> None:
        nonlocal longest, last
        while not done.is_set():
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(tick())
    checker = BodyChecker()
    started = time.monotonic()
    try:
        await checker.check(ChatCompletionRequest, LARGE_BODY)
    except Exception as exc:  # (any answer counts: its time is what is measured)
        print(f"the checker answered {type(exc).__name__}")
    answered_s = time.monotonic() - started
    done.set()
    await ticker
    checker.close()
    return {"first_answer_s": answered_s, "longest_loop_gap_s": longest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tick-ms", type=float, default=10.0, help="the ticker's interval")
    args = parser.parse_args()
    result = asyncio.run(measure(args.tick_ms / 1000))
    print(
        f"first large body answered in {result['first_answer_s']:.2f} s; "
        f"the event loop's longest gap between {args.tick_ms:g} ms ticks: {result['longest_loop_gap_s'] * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
