"""Queue-length autoscaling on the bed, as deploy/config.sim.yaml ships it: out under load, back after.

While several replicas run under load, one engine fails. Every answer it was generating or
holding gets one explicit error (``engine_failed``) and is never sent to another replica: the
request may be what killed the engine. Every other request, and every request sent right
after, reaches its client complete: the dead replica's front door sends what it had not
admitted on to the other replicas until Serve, whose health checks of it fail, stops it (with
its engine's death leaves its process running).
No other replica dies.

The suite's ``glm-autoscaled`` application runs it: the bed with the shipped
autoscaling_config from one replica, and shorter downscale delay and look-back
(tests/e2e/harness/apps.py, AUTOSCALED), so that it comes back within the test.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest
import ray
from ray.exceptions import ActorDiedError

from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import AUTOSCALED, BED_REPLACES_S, bed_autoscaling
from tests.e2e.harness.bodies import chat
from tests.e2e.harness.serve_state import (
    death_reason,
    ongoing_at,
    request_log_lines,
    running_replica_actors,
    single_replica,
)
from tests.e2e.harness.simulation import ready_bed
from tests.waiting import wait_until

pytestmark = [pytest.mark.applications("glm-autoscaled"), pytest.mark.alone]

# Users that each send one answer after another: Serve counts about 48 ongoing requests, three
# times glm-autoscaled's target (16 per replica, a third of the shipped 48: apps.AUTOSCALED), so
# it asks for 3 replicas, as 128 clients did at the shipped target (a third of the HTTP work).
CLIENTS = 48
# Long enough answers that the clients send few requests a second: under 128 clients sending
# 128-token answers at an H100's pace, the suite's 2 cores went to HTTP and a new replica took
# over 30 s to start. At glm-autoscaled's slower steps (apps.SLOWER_STEPS) an answer takes
# about 7 s, and 48 clients send about 7 requests a second.
TOKENS = 256
HELD_AT_DEATH = 8  # the failing replica holds at least this many requests when its engine fails
AFTER_DEATH = 32


def user_client(url: str) -> httpx.AsyncClient:
    """One user's client: one connection, kept alive.

    With a pool, httpx could reuse a keep-alive connection that expired while idle after
    handing it to the next request (encode/httpcore#1110); one connection carrying one
    request after another never idles.
    """
    limits = httpx.Limits(max_connections=1, keepalive_expiry=None)
    return httpx.AsyncClient(base_url=url, timeout=120, limits=limits)


async def test_scales_out_under_load_an_engine_death_stays_local_and_scales_back(variants, cluster):
    await scale_out_fail_one_and_scale_back(await ready_bed(variants["glm-autoscaled"]), bed_autoscaling() | AUTOSCALED)


async def scale_out_fail_one_and_scale_back(bed, scaling: dict) -> None:
    app = bed.app
    stop = asyncio.Event()
    answered: list[str] = []  # request ids answered in full
    engine_failed: list[str] = []  # request ids whose engine died under them
    unexpected: dict[str, str] = {}  # request id: any other answer (none is expected)

    async def keep_busy() -> None:
        async with user_client(app.url) as client:
            while not stop.is_set():
                request_id = uuid.uuid4().hex
                response = await client.post(
                    "/v1/chat/completions", json=chat(app.model, TOKENS), headers={"X-Request-Id": request_id}
                )
                if response.status_code == 500 and response.json()["error"]["code"] == "engine_failed":
                    engine_failed.append(request_id)
                elif response.status_code == 200 and response.json()["usage"]["completion_tokens"] == TOKENS:
                    answered.append(request_id)
                else:
                    unexpected[request_id] = f"{response.status_code} {response.text[:300]}"

    async def send_once(tokens: int) -> httpx.Response:
        async with user_client(app.url) as client:
            return await client.post("/v1/chat/completions", json=chat(app.model, tokens))

    workers = [asyncio.create_task(keep_busy()) for _ in range(CLIENTS)]
    try:

        async def scaled_out() -> set[str] | None:
            replicas = await running_replica_actors(bed.model)
            return replicas if len(replicas) >= 2 else None

        replicas = await wait_until(scaled_out, 180, "scaled out to 2 running replicas")
        print(f"scaled out to {len(replicas)} running replicas under {CLIENTS} clients ({len(answered)} answers)")
        # Under the same load, the engine of the busiest running replica fails while it holds
        # requests: paused first, so what it holds cannot finish before it fails. Another
        # running replica takes what comes after.
        ongoing = {}
        for replica in replicas:
            try:
                ongoing[replica] = await ongoing_at(replica)
            except ActorDiedError:  # Serve stopped it meanwhile (scaling): not a candidate
                continue
        victim = max(ongoing, key=ongoing.__getitem__)
        survivors = set(ongoing) - {victim}
        await bed.engines.control(victim, Control.PAUSE)

        async def holds_requests() -> bool:
            return (await bed.engines.control(victim, Control.STATE)).holds >= HELD_AT_DEATH

        await wait_until(holds_requests, 30, f"the paused engine holding {HELD_AT_DEATH}")
        await bed.engines.control(victim, Control.FAIL)
        responses = await asyncio.gather(*(send_once(8) for _ in range(AFTER_DEATH)))

        async def victim_left() -> str | None:
            return await death_reason(victim)

        # The failed engine's replica is gone: stopped by Serve (RAY_KILL) as it scaled, or after
        # failed health checks (its process stays until then, see EngineServer._leave). No
        # other replica died: Serve may stop one as it scales (RAY_KILL), which is no death.
        reason = await wait_until(victim_left, BED_REPLACES_S, "the failed engine's replica gone")
        print(f"the failed engine's replica left: {reason}")
        assert "WORKER_DIED" not in [await death_reason(survivor) for survivor in survivors]
    finally:
        stop.set()
        await asyncio.gather(*workers)
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()
    # Every other answer, before and after the engine died, was complete; what was not, and
    # where it went (the request log line of the replica that answered it), when one was not.
    assert not unexpected, await asyncio.to_thread(where_they_went, unexpected, session_dir, app.name)
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * AFTER_DEATH, [r.text for r in responses if r.status_code != 200][:3]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    # The answers the dead engine held were answered once each, never sent to another replica:
    # the replicas' request log (by X-Request-Id) shows one attempt for each.
    assert len(engine_failed) >= HELD_AT_DEATH, engine_failed

    async def all_logged() -> dict | None:  # (Serve writes a request's line as it ends)
        logged = await asyncio.to_thread(request_log_lines, session_dir, app.name)
        return logged if all(i in logged for i in engine_failed + answered[-100:]) else None

    logged = await wait_until(all_logged, 30, "the requests in the replicas' log")
    for request_id in engine_failed:
        line = logged[request_id]
        assert (line["status"], line["error"], line["attempts"]) == (500, "engine_failed", 1), line
    back = await timed_single_replica(bed)
    print(
        f"{len(answered)} answers in all; {len(engine_failed)} held by the engine that failed got one error each "
        f"and never reached another replica; back to {scaling['min_replicas']} replica in {back:.0f} s"
    )


def where_they_went(unexpected: dict[str, str], session_dir: str, app_name: str) -> str:
    """Each unexpected answer with the request log line of the replica that answered it (blocking)."""
    logs = sorted(Path(session_dir, "logs", "serve").glob(f"replica_{app_name}_*.log"))
    found = {log.stem: request_log_lines(session_dir, app_name, replica=log.stem.rsplit("_", 1)[-1]) for log in logs}
    return "\n".join(
        f"{answer}\n  logged: {[(log, lines[request_id]) for log, lines in found.items() if request_id in lines]}"
        for request_id, answer in unexpected.items()
    )


async def timed_single_replica(bed) -> float:
    started = asyncio.get_running_loop().time()
    await single_replica(bed.model, within_s=120)
    return asyncio.get_running_loop().time() - started
