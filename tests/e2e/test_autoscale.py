"""Queue-length autoscaling on the real app: out to 2 replicas under load, back to 1 after.

It leaves the app as it found it (one idle replica). It runs before any test
holds a Serve handle in this process, so only the app's own ingress reports
queue lengths to the autoscaler, as in production.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import yaml

from tests.e2e.serve_state import replica_states, wait_until


async def test_queue_length_scales_out_to_two_replicas_and_back_to_one(app, cluster):
    application = yaml.safe_load(app.config_path.read_text())["applications"][0]
    deployment = SimpleNamespace(app_name=application["name"], deployment_name=f"model-{app.model}")

    async def running(count: int) -> bool:
        return (await replica_states(deployment)).get("RUNNING", 0) >= count

    async def only_running(count: int) -> bool:
        return await replica_states(deployment) == {"RUNNING": count}

    await wait_until(lambda: only_running(1), timeout_s=240, what="at 1 replica")
    stop = asyncio.Event()
    body = {"model": app.model, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 512, "min_tokens": 512, "stream": True}
    limits = httpx.Limits(max_connections=120, max_keepalive_connections=120)
    async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=limits) as client:
        async def keep_busy() -> None:
            while not stop.is_set():
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_lines():
                        pass
        # 96 streams against max_ongoing_requests 64: 64 running and 32 queued on one
        # replica, three times target_ongoing_requests (32), until a second one runs.
        workers = [asyncio.create_task(keep_busy()) for _ in range(96)]
        try:
            out = await wait_until(lambda: running(2), timeout_s=300, what="scaled out to 2 running replicas")
        finally:
            stop.set()
            await asyncio.gather(*workers)  # every stream answered 200
    back = await wait_until(lambda: only_running(1), timeout_s=180, what="back to 1 replica")
    print(f"scaled out in {out:.0f} s, back to 1 in {back:.0f} s")
