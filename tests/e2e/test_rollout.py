"""A rolling config change on the real app: an operator turns API keys on.

Changing the application's arguments replaces every replica. Streams from clients
that already send their key flow through the replacement and complete in full;
afterwards every ``/v1/*`` request needs a key, ``/health`` does not, a rotated
key file takes effect without a restart, and no key is ever written to a log.

It changes the shared app's config and leaves keys on, so it runs last.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import ray
import yaml

from tests.e2e.serve_state import only_one_running, replica_states, wait_until
from tests.e2e.sse import post_stream

pytestmark = pytest.mark.disruptive

KEYS = ("sk-e2e-first-4f1c9a", "sk-e2e-second-77b2d0")
ROTATED = "sk-e2e-rotated-c3e8aa"


def chat(model: str, tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Keep talking."}],
        "max_tokens": tokens,
        "min_tokens": tokens,
    } | extra


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def serve_deploy(config: Path, cluster: str) -> None:
    """``serve deploy`` the config to the running cluster, as an operator would."""
    deploy = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("serve")), "deploy", str(config), "--address", cluster,
        env=os.environ | {"RAY_AUTH_MODE": "token"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    output, _ = await deploy.communicate()
    assert deploy.returncode == 0, output.decode()


async def test_turning_api_keys_on_rolls_out_without_cutting_a_stream(app, one_replica, cluster, tmp_path):
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("\n".join(KEYS) + "\n")
    config = yaml.safe_load(app.config_path.read_text())
    config["applications"][0]["args"]["ingress"]["api_keys"] = {"file": str(keys_file)}
    keyed = app.config_path.with_name("with-api-keys.yaml")
    keyed.write_text(yaml.safe_dump(config, sort_keys=False))

    rollout_done = asyncio.Event()
    results: list[tuple[bool, int]] = []
    # The clients send their key before keys are required; it is ignored until then.
    async with httpx.AsyncClient(base_url=app.url, timeout=120, headers=bearer(KEYS[0])) as client:

        async def stream_until_rolled_out() -> None:
            body = chat(app.model, 256, stream=True, stream_options={"include_usage": True})
            while not rollout_done.is_set():
                stream = await post_stream(client, "/v1/chat/completions", body)
                usage = stream.chunks[-1].get("usage") if stream.chunks else None
                results.append((stream.status == 200 and stream.done, usage and usage["completion_tokens"]))

        workers = [asyncio.create_task(stream_until_rolled_out()) for _ in range(16)]
        try:
            await serve_deploy(keyed, cluster)
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

    await wait_until(lambda: _keys_required(app.url), timeout_s=60, what="requiring API keys")
    _check_keys_are_required(app)
    await _check_rotation(app, keys_file)
    _check_no_key_is_logged(app)


def _check_keys_are_required(app) -> None:
    for headers in ({}, bearer("sk-e2e-wrong"), {"Authorization": KEYS[0]}):
        response = httpx.post(f"{app.url}/v1/chat/completions", json=chat(app.model, 8), headers=headers, timeout=60)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert "sk-e2e" not in response.text
    for key in KEYS:
        response = httpx.post(f"{app.url}/v1/chat/completions", json=chat(app.model, 8), headers=bearer(key), timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(f"{app.url}/health", timeout=30).status_code == 200
    # The OpenAI SDK sends its api_key the same way and raises its own error for a wrong one.
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key=KEYS[1], max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [app.model]
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key="sk-e2e-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


async def _check_rotation(app, keys_file: Path) -> None:
    """A rewritten key file (as Kubernetes updates a mounted Secret) takes effect with no restart."""
    keys_file.write_text(ROTATED + "\n")
    await wait_until(lambda: _accepts(app.url, ROTATED), timeout_s=30, what="accepting the rotated key")
    assert not await _accepts(app.url, KEYS[0])


def _check_no_key_is_logged(app) -> None:
    session_logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    logged = [p for p in [app.log_path, *session_logs.rglob("*")] if p.is_file() and _mentions_a_key(p)]
    assert not logged, f"a key appears in {logged}"


def _mentions_a_key(path: Path) -> bool:
    text = path.read_bytes()
    return any(key.encode() in text for key in (*KEYS, ROTATED))


async def _keys_required(url: str) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return (await client.get("/v1/models")).status_code == 401


async def _accepts(url: str, key: str) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return (await client.get("/v1/models", headers=bearer(key))).status_code == 200


async def _replacing(handle) -> bool:
    return sum((await replica_states(handle)).values()) > 1
