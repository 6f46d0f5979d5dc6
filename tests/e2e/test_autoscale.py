"""Queue-length autoscaling on the real app: out to 2 replicas under load, back to 1 after.

While two replicas run under load, one engine is killed: every answer it was
generating or holding, and every request sent right after, must still reach its
client complete (the dead replica refuses them as retryable, the ingress sends
them again, and the dead replica leaves routing at its next health check). This rides on
the scale-out because two running replicas are what it needs, and a second
engine costs minutes of CPU here.

It changes the replica count, so it runs with the other tests that disturb the
app, and it leaves the app as it found it: one idle replica.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
import yaml

from tests.e2e.serve_state import replica_engines, running, single_replica, wait_until

pytestmark = pytest.mark.disruptive

# Users that each send one answer after another: twice as many as one replica
# runs at once (max_ongoing_requests 64), so the other half wait at the ingress's
# handle and Serve counts about 128 ongoing requests, four times the target (32).
# Unary answers of 128 tokens keep the users' own work small; those that queue
# have the whole 60 s request limit.
CLIENTS = 128
AFTER_DEATH = 32  # extra requests sent right after one of the two engines died


def user_client(url: str) -> httpx.AsyncClient:
    """One simulated user: its own client with one connection, sending one request at a time.

    Not one client shared by all: httpx's connection pool scans every connection on
    each request and each response, so a pool of 128 busy connections spent this
    test process's CPU on itself (about 3 answers a second) and kept only a few
    requests at the server, which Serve rightly read as no load.
    keepalive_expiry=None: httpcore 1.0.9 can close a connection that expired while
    idle after handing it to the next request (encode/httpcore#1110); the client
    then never closes a connection itself, and Serve's 75 s keep-alive never lapses
    here, as each connection carries one request after another.
    """
    limits = httpx.Limits(max_connections=1, keepalive_expiry=None)
    return httpx.AsyncClient(base_url=url, timeout=120, limits=limits)


def chat(model: str, tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": tokens,
        "min_tokens": tokens,
    } | extra


async def test_scales_out_under_load_loses_nothing_when_an_engine_dies_and_scales_back(app, one_replica):
    config = yaml.safe_load(app.config_path.read_text())["applications"][0]["args"]["models"][0]["deployment"]
    assert config["max_ongoing_requests"] == 64 and config["autoscaling_config"]["target_ongoing_requests"] == 32
    stop = asyncio.Event()
    answered = 0

    async def keep_busy() -> None:
        nonlocal answered
        async with user_client(app.url) as client:
            while not stop.is_set():
                response = await client.post("/v1/chat/completions", json=chat(app.model, 128))
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 128
                answered += 1

    async def send_once(tokens: int) -> httpx.Response:
        async with user_client(app.url) as client:
            return await client.post("/v1/chat/completions", json=chat(app.model, tokens))

    workers = [asyncio.create_task(keep_busy()) for _ in range(CLIENTS)]
    try:
        # A second engine loads in 1-4 min on 2 cores busy with the load itself.
        out = await wait_until(lambda: running(one_replica, 2), timeout_s=480, what="scaled out to 2 running replicas")
        print(f"scaled out in {out:.0f} s under {CLIENTS} clients ({answered} answers)")
        # Under the same load, one of the two engines dies. Answers it was generating
        # or holding are refused as retryable and sent again; none reaches a client
        # as an error (every worker asserts a complete 200).
        engines = await asyncio.to_thread(replica_engines, one_replica)
        assert len(engines) == 2 and all(engines.values()), engines
        victim = next(iter(engines.values()))
        for process in victim:
            process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(lambda: [p.wait(timeout=30) for p in victim])
        responses = await asyncio.gather(*(send_once(8) for _ in range(AFTER_DEATH)))
    finally:
        stop.set()
        await asyncio.gather(*workers)  # every answer, before and after the engine died, was complete
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * AFTER_DEATH, [r.text for r in responses if r.status_code != 200][:3]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    back = await single_replica(one_replica)
    print(f"{answered} answers in all, none lost when an engine died; back to 1 replica in {back:.0f} s")
