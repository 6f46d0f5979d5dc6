"""Queue-length autoscaling on the real app: out to 2 replicas under load, back to 1 after.

It changes the replica count, so it runs with the other tests that disturb the
app, and it leaves the app as it found it: one idle replica.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml

from tests.e2e.serve_state import running, single_replica, wait_until

pytestmark = pytest.mark.disruptive

# As many streams as one replica admits (max_ongoing_requests 64): twice the
# config's target_ongoing_requests (32), and none waits in a queue, so none can
# run into the first-token limit while the second engine loads.
STREAMS = 64


async def test_queue_length_scales_out_to_two_replicas_and_back_to_one(app, one_replica):
    config = yaml.safe_load(app.config_path.read_text())["applications"][0]["args"]["models"][0]["deployment"]
    assert config["max_ongoing_requests"] == STREAMS and config["autoscaling_config"]["target_ongoing_requests"] == 32
    body = {
        "model": app.model,
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 128,
        "min_tokens": 128,
        "stream": True,
    }
    stop = asyncio.Event()
    answered: list[int] = []
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=limits) as client:

        async def keep_busy() -> None:
            while not stop.is_set():
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]", events[-1]
                answered.append(response.status_code)

        workers = [asyncio.create_task(keep_busy()) for _ in range(STREAMS)]
        try:
            out = await wait_until(lambda: running(one_replica, 2), timeout_s=300, what="scaled out to 2 running replicas")
        finally:
            stop.set()
            await asyncio.gather(*workers)  # every stream, before and during the scale-out, completed
    back = await single_replica(one_replica)
    print(f"scaled out in {out:.0f} s under {STREAMS} streams ({len(answered)} answered), back to 1 in {back:.0f} s")
