"""The CPU engine's start, compiled by torch's inductor or eager, with cold compile caches.

    python -m benchmarks.cpu_engine_start --mode compiled
    python -m benchmarks.cpu_engine_start --mode eager

Starts vLLM's own OpenAI server on the tiny model with deploy/config.cpu.yaml's engine
arguments, its compile caches in a fresh directory (as on a fresh clone or a CI machine),
and prints the seconds until ``/health`` answers, then two batches of 64 concurrent requests
of 128 tokens each. One at a time, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import httpx

PORT = 18123
MODEL = "models/tiny-glm4"
ENGINE_ARGS = ["--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64"]
ENGINE_ARGS += ["--gpu-memory-utilization", "0.15", "--disable-log-stats"]
BATCH, TOKENS = 64, 128


def start(mode: str, cache: str, log: str) -> subprocess.Popen:
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
    }
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--port", str(PORT)]
    args += ENGINE_ARGS + (["--enforce-eager"] if mode == "eager" else [])
    with open(log, "w") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, within_s: float = 600) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"not ready within {within_s} s")


async def batch() -> float:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300) as client:
        started = time.monotonic()
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(BATCH)))
        took = time.monotonic() - started
    assert all(a.json()["usage"]["completion_tokens"] == TOKENS for a in answers)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["compiled", "eager"], required=True)
    parser.add_argument("--log", default=None, help="the server's output (default: a temporary file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="engine-cache-") as cache:
        log = args.log or os.path.join(cache, "server.log")
        started = time.monotonic()
        proc = start(args.mode, cache, log)
        try:
            wait_ready(proc)
            ready = time.monotonic() - started
            first, second = asyncio.run(batch()), asyncio.run(batch())
        finally:
            proc.terminate()
            proc.wait(60)
    batches = f"{BATCH} x {TOKENS} tokens: first batch {first:.1f} s, second {second:.1f} s"
    print(f"{args.mode}: ready in {ready:.1f} s; {batches}")


if __name__ == "__main__":
    main()
