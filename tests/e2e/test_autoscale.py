"""Queue-length autoscaling on the real app: out to 2 replicas under load, back to 1 after.

While two replicas run under load, one engine is killed. Every answer it was
generating or holding gets one explicit error (``engine_failed``) and is never
sent to the other replica: the request may be what killed the engine. Every
other request, and every request sent right after, reaches its client complete
(the dead replica refuses what it had not admitted as retryable, and leaves
routing within seconds). Exactly one replica dies. This rides on the scale-out
because two running replicas are what it needs, and a second engine costs
minutes of CPU here.

It changes the replica count, so it runs with the other tests that disturb the
app, and it leaves the app as it found it: one idle replica.
"""

from __future__ import annotations

import asyncio
import signal
import uuid

import httpx
import pytest
import yaml

from tests.e2e.serve_state import (
    death_reason,
    ongoing_at,
    replica_engines,
    request_log_lines,
    running,
    single_replica,
    wait_until,
)

pytestmark = pytest.mark.disruptive

# Users that each send one answer after another: twice as many as one replica
# runs at once (max_ongoing_requests 64), so the other half wait at the ingress's
# handle and Serve counts about 128 ongoing requests, four times the target (32).
# Unary answers of 128 tokens keep the users' own work small; those that queue
# have the whole 60 s request limit.
CLIENTS = 128
AFTER_DEATH = 32  # extra requests sent right after one of the two engines died
HELD_AT_DEATH = 4  # requests the dying engine's replica holds, at least, when it is killed


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


async def test_scales_out_under_load_an_engine_death_stays_local_and_scales_back(app, one_replica):
    import ray

    config = yaml.safe_load(app.config_path.read_text())["applications"][0]["args"]["models"][0]["deployment"]
    assert config["max_ongoing_requests"] == 64 and config["autoscaling_config"]["target_ongoing_requests"] == 32
    stop = asyncio.Event()
    answered: list[str] = []  # request ids answered in full
    engine_failed: list[str] = []  # request ids whose engine died under them

    async def keep_busy() -> None:
        async with user_client(app.url) as client:
            while not stop.is_set():
                request_id = uuid.uuid4().hex
                response = await client.post(
                    "/v1/chat/completions", json=chat(app.model, 128), headers={"X-Request-Id": request_id}
                )
                if response.status_code == 500 and response.json()["error"]["code"] == "engine_failed":
                    engine_failed.append(request_id)
                    continue
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 128
                answered.append(request_id)

    async def send_once(tokens: int) -> httpx.Response:
        async with user_client(app.url) as client:
            return await client.post("/v1/chat/completions", json=chat(app.model, tokens))

    (first_replica,) = await asyncio.to_thread(replica_engines, one_replica)  # busy from the start
    workers = [asyncio.create_task(keep_busy()) for _ in range(CLIENTS)]
    try:
        # A second engine loads in 1-4 min on 2 cores busy with the load itself.
        out = await wait_until(lambda: running(one_replica, 2), timeout_s=480, what="scaled out to 2 running replicas")
        print(f"scaled out in {out:.0f} s under {CLIENTS} clients ({len(answered)} answers)")
        # Under the same load, the engine of the busier replica dies while it holds requests.
        # It is frozen first, so that what its replica holds cannot finish before the kill
        # (a replica seen busy through a handle had drained by the time of the kill in CI).
        engines = await asyncio.to_thread(replica_engines, one_replica)
        assert len(engines) == 2 and all(engines.values()) and first_replica in engines, engines
        ongoing = {replica: await asyncio.to_thread(ongoing_at, replica) for replica in engines}
        victim = max(ongoing, key=ongoing.__getitem__)
        victim_engine = engines[victim]
        (survivor,) = set(engines) - {victim}
        for process in victim_engine:
            process.send_signal(signal.SIGSTOP)

        async def holds_requests() -> bool:
            return await asyncio.to_thread(ongoing_at, victim) >= HELD_AT_DEATH

        # Within the replica's engine_stall_timeout_s (20 s), after which it would fail them itself.
        await wait_until(holds_requests, timeout_s=15, what=f"the frozen engine's replica holding {HELD_AT_DEATH}")
        for process in victim_engine:
            process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(lambda: [p.wait(timeout=30) for p in victim_engine])
        responses = await asyncio.gather(*(send_once(8) for _ in range(AFTER_DEATH)))
    finally:
        stop.set()
        await asyncio.gather(*workers)  # every other answer, before and after the engine died, was complete
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * AFTER_DEATH, [r.text for r in responses if r.status_code != 200][:3]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    # Exactly one replica died, by its own exit after its engine's death.
    assert await asyncio.to_thread(death_reason, victim) == "WORKER_DIED"
    assert await asyncio.to_thread(death_reason, survivor) is None
    # The answers the dead engine held were answered once each, never sent to another replica:
    # the ingress's request log (by X-Request-Id) shows one attempt for each.
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()
    logged = await asyncio.to_thread(request_log_lines, session_dir)
    # Without an engine_failed answer, either the engine held nothing when it was killed,
    # or its requests were sent again after the replica's exit (a second attempt): say which.
    sent_again = [i for i in answered if i in logged and logged[i]["attempts"] > 1]
    assert engine_failed, f"the killed engine held no request; {len(sent_again)} answers took a second attempt"
    assert all(i in logged for i in answered[-100:])  # the log names the requests it served
    for request_id in engine_failed:
        line = logged[request_id]
        assert (line["status"], line["error"], line["attempts"]) == (500, "engine_failed", 1), line
    back = await single_replica(one_replica)
    print(
        f"{len(answered)} answers in all; {len(engine_failed)} held by the engine that died got one error each "
        f"and never reached the other replica; back to 1 replica in {back:.0f} s"
    )
