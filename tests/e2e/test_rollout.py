"""Rolling config changes on the real app. They change the shared app (its replicas
and config), so they run after every other test."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.serve_state import only_one_running, replica_states, wait_until
from tests.e2e.sse import post_stream

pytestmark = pytest.mark.disruptive


def chat(model: str, tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Keep talking."}],
        "max_tokens": tokens,
        "min_tokens": tokens,
    } | extra


async def test_config_change_replaces_replicas_without_cutting_a_stream(app, one_replica, cluster):
    """Streams keep flowing through a rolling replacement; every one completes in full."""
    config = yaml.safe_load(app.config_path.read_text())
    model = config["applications"][0]["args"]["models"][0]
    model["deployment"]["ray_actor_options"]["num_cpus"] = 0.45  # a change that needs new replicas
    changed = app.config_path.with_name("changed.yaml")
    changed.write_text(yaml.safe_dump(config, sort_keys=False))

    rollout_done = asyncio.Event()
    results: list[tuple[bool, int]] = []
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:

        async def stream_until_rolled_out() -> None:
            body = chat(app.model, 256, stream=True, stream_options={"include_usage": True})
            while not rollout_done.is_set():
                stream = await post_stream(client, "/v1/chat/completions", body)
                usage = stream.chunks[-1].get("usage") if stream.chunks else None
                results.append((stream.status == 200 and stream.done, usage and usage["completion_tokens"]))

        workers = [asyncio.create_task(stream_until_rolled_out()) for _ in range(16)]
        try:
            deploy = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).with_name("serve")), "deploy", str(changed), "--address", cluster,
                env=os.environ | {"RAY_AUTH_MODE": "token"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
            output, _ = await deploy.communicate()
            assert deploy.returncode == 0, output.decode()
            # A replacement starts next to the old replica (max_surge_percent), then the old one drains.
            await wait_until(lambda: _replacing(one_replica), timeout_s=60, what="replacing the replica")
            took = await wait_until(
                lambda: only_one_running(one_replica), timeout_s=300, what="rolled out to the new config"
            )
        finally:
            rollout_done.set()
            await asyncio.gather(*workers)
    incomplete = [r for r in results if r != (True, 256)]
    print(f"rolled out in {took:.0f} s; {len(results)} streams ran through it")
    assert results and not incomplete, f"{len(incomplete)} of {len(results)} streams were cut: {incomplete[:5]}"
    response = httpx.post(f"{app.url}/v1/chat/completions", json=chat(app.model, 8), timeout=60)
    assert response.status_code == 200, response.text


async def _replacing(handle) -> bool:
    return sum((await replica_states(handle)).values()) > 1
