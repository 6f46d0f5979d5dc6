"""Rolling config changes on the bed's variants (tests/e2e/harness/apps.py): an operator turns API keys on,
and per-key limits hold across replicas.

On ``glm-rollout`` (the bed with Serve's production drain of a stopping replica), changing the
application's arguments replaces every replica. Streams from clients that already send their
key flow through the replacement and complete in full, and so do long answers begun on the
replaced replica, which outlive the hard stop Serve's HAProxy would give them by default after
its reload (deploy/cluster.env sets a longer one); afterwards every ``/v1/*`` request needs
a key, ``/health`` does not, a rotated key file takes effect without a restart, and no key is
ever written to a log. The application is the test's own: it stays keyed.
On ``glm-rate-limited``, per-key rate limits are on with two model replicas answering clients,
which together admit exactly the configured rate.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import ray
import yaml

from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.apps import LIMITED_KEYS, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, application
from tests.e2e.harness.bodies import chat, grpc_chat
from tests.e2e.harness.grpc_calls import call, channel
from tests.e2e.harness.haproxy import hard_stop_after_s, watching_reloads
from tests.e2e.harness.serve_state import (
    DeploymentName,
    live_replicas,
    only_one_running,
    replica_states,
    serve_deploy_preserving,
)
from tests.e2e.harness.simulation import ready_bed
from tests.e2e.harness.sse import Stream, post_stream
from tests.waiting import wait_until
from tools.cluster_env import cluster_env

pytestmark = pytest.mark.applications("glm-rollout", "glm-rate-limited")

KEYS = ("sk-e2e-first-4f1c9a-0123456789", "sk-e2e-second-77b2d0-0123456789")
ROTATED = "sk-e2e-rotated-c3e8aa-0123456789"
# Answers that began before the rollout, on the replica it replaces: LONG_TOKENS each (about 3
# minutes at glm-rollout's pace, however long the rollout takes), the old replica stepping
# SLOW_PACE times slower once replaced (about 0.3 s a token) until the rollout is over, then
# QUICK_PACE times (their last tokens within seconds).
LONG_ANSWERS, LONG_TOKENS = 4, 6000
SLOW_PACE, QUICK_PACE = 10.0, 0.05
# Serve's default RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S, which cut every answer an old HAProxy
# process still carried this long after a reload; deploy/cluster.env sets 1020 s.
RAY_DEFAULT_HARD_STOP_S = 120


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_turning_api_keys_on_rolls_out_without_cutting_a_stream(variants, cluster, tmp_path):
    """Streams sent through the rollout all end whole, and so do long answers that began before
    it, carried on by the old HAProxy process they connected to; that process runs with
    deploy/cluster.env's hard stop, not Serve's default (RAY_DEFAULT_HARD_STOP_S after the reload),
    read from its configuration rather than waited out (HAProxy keeps its old process's
    connections until ``hard-stop-after``: its own contract)."""
    rollout = await ready_bed(variants["glm-rollout"])
    app, model, engines = rollout.app, rollout.model, rollout.engines
    (old,) = await engines.replicas()
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("\n".join(KEYS) + "\n")
    config = yaml.safe_load(app.config_path.read_text())
    keyed_app = application(config, app.name)
    keyed_app["args"]["ingress"]["api_keys"] = {"file": str(keys_file)}
    # The replica being replaced drains for Serve's production period (what this test proves no
    # stream is cut through); its replacement drains as the suite's cluster does.
    keyed_app["runtime_env"]["env_vars"]["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
    keyed = tmp_path / "with-api-keys.yaml"
    keyed.write_text(yaml.safe_dump(config, sort_keys=False))

    rollout_done = asyncio.Event()
    results: list[tuple[bool, int]] = []
    # The clients send their key before keys are required; it is ignored until then.
    async with (
        httpx.AsyncClient(base_url=app.url, timeout=120, headers=bearer(KEYS[0])) as client,
        watching_reloads() as reloads,
    ):

        async def stream_until_rolled_out() -> None:
            body = chat(app.model, 256, stream=True, stream_options={"include_usage": True})
            while not rollout_done.is_set():
                stream = await post_stream(client, "/v1/chat/completions", body)
                results.append(_outcome(stream))

        long_body = chat(app.model, LONG_TOKENS, stream=True, stream_options={"include_usage": True})
        long_answers = [
            asyncio.create_task(post_stream(client, "/v1/chat/completions", long_body)) for _ in range(LONG_ANSWERS)
        ]
        await engines.wait_until_holding(LONG_ANSWERS)
        connected = time.time()  # every long answer is under way through the HAProxy process of now
        workers = [asyncio.create_task(stream_until_rolled_out()) for _ in range(16)]
        picker = DeploymentName(app.name, "ReplicaPicker")
        old_pickers = set(await live_replicas(picker))
        try:
            started = time.monotonic()
            await serve_deploy_preserving(keyed, app.config_path, cluster)  # the application is this test's own
            # A replacement starts next to the old replica (max_surge_percent), then the old one drains
            # (as long as the long answers last: its graceful_shutdown_timeout_s allows them).
            await wait_until(lambda: _replacing(model), 60, "replacing the replica")
            await wait_until(lambda: _replaced(model), 300, "the new replica running, the old one stopping")
            took = time.monotonic() - started
            # From now on the old replica steps slowly, so that the long answers are still streaming
            # from it, through the HAProxy process they connected to, past Serve's default hard stop.
            await engines.control(old, Control.PACE, SLOW_PACE)
            assert not any(answer.done() for answer in long_answers), f"the rollout outlasted {LONG_TOKENS} tokens"
            # The streams go on through the old picker's drain (it answers HAProxy's old process while
            # Serve drains it), until it is gone.
            await wait_until(lambda: _none_alive(picker, old_pickers), 120, "the old picker gone")
        finally:
            rollout_done.set()
        # The application is this test's own and stays keyed: no test uses it after, and its
        # replacement drains as the suite's cluster does (the suite's stop waits on no production timer).
        await wait_until(lambda: _keys_required(app.url), 60, "requiring API keys")
        _check_keys_are_required(app)
        await _check_grpc_calls_need_a_key(app)
        await _check_rotation(app, keys_file)

        reload = reloads.first_after(connected)
        assert reload is not None, "HAProxy was not reloaded while the long answers streamed"
        shipped = int(cluster_env()["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"])
        assert shipped > RAY_DEFAULT_HARD_STOP_S and await asyncio.to_thread(hard_stop_after_s) == {shipped}
        ended = [answer.exception() or _outcome(answer.result()) for answer in long_answers if answer.done()]
        assert not ended, f"long answers ended before the rollout was over: {ended}"
        await engines.control(old, Control.PACE, QUICK_PACE)  # the long answers' last tokens, quickly
        await asyncio.gather(*workers)
        long_results = [_outcome(stream) for stream in await asyncio.gather(*long_answers)]
        await wait_until(lambda: only_one_running(model), 120, "the old replica gone once its answers ended")
    incomplete = [r for r in results if r != (True, 256)]
    print(f"rolled out in {took:.0f} s; {len(results)} streams ran through it")
    assert results and not incomplete, f"{len(incomplete)} of {len(results)} streams were cut: {incomplete[:5]}"
    assert long_results == [(True, LONG_TOKENS)] * LONG_ANSWERS, long_results
    _check_no_key_is_logged(app)


def _outcome(stream: Stream) -> tuple[bool, int]:
    """Whether a stream ended whole (200, ``[DONE]``), and the tokens its usage chunk counts."""
    usage = stream.chunks[-1].get("usage") if stream.chunks else None
    return stream.status == 200 and stream.done, usage["completion_tokens"] if usage else 0


def _check_keys_are_required(app) -> None:
    for headers in ({}, bearer("sk-e2e-wrong"), {"Authorization": KEYS[0]}):
        response = httpx.post(f"{app.url}/v1/chat/completions", json=chat(app.model, 8), headers=headers, timeout=60)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert "sk-e2e" not in response.text
    for key in KEYS:
        response = httpx.post(
            f"{app.url}/v1/chat/completions", json=chat(app.model, 8), headers=bearer(key), timeout=60
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(f"{app.url}/health", timeout=30).status_code == 200
    # The OpenAI SDK sends its api_key the same way and raises its own error for a wrong one.
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key=KEYS[1], max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [app.model]
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key="sk-e2e-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


async def _check_grpc_calls_need_a_key(app) -> None:
    """gRPC: the same keys from ``authorization`` metadata; UNAUTHENTICATED (and a final error response) without one."""
    request = grpc_chat(app.model, 8)
    async with channel(app) as grpc_channel:
        stub = pb_grpc.GenerationStub(grpc_channel)
        for metadata in ((), (("authorization", "Bearer sk-e2e-wrong"),)):
            refused = await call(stub.ChatCompletion, request, metadata=metadata)
            assert refused.code == grpc.StatusCode.UNAUTHENTICATED, refused.details
            assert [r.error.code for r in refused.responses] == ["invalid_api_key"]  # one final response
            assert "sk-e2e" not in refused.details
        key = (("authorization", f"Bearer {KEYS[1]}"),)
        responses = [r async for r in stub.ChatCompletion(request, metadata=key)]
        assert responses[-1].final and responses[-1].usage.completion_tokens > 0


async def _check_rotation(app, keys_file: Path) -> None:
    """A rewritten key file (as Kubernetes updates a mounted Secret) takes effect with no restart."""
    keys_file.write_text(ROTATED + "\n")
    await wait_until(lambda: _accepts(app.url, ROTATED), 30, "accepting the rotated key")
    assert not await _accepts(app.url, KEYS[0])


def _session_logs() -> Path:
    return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"


def _logs_naming(answering: DeploymentName, request_ids: list[str]) -> list[Path]:
    """The log files of the replicas answering clients (Serve writes one per replica) that name any of the requests."""
    return [
        path
        for path in (_session_logs() / "serve").glob(f"replica_{answering.app_name}_{answering.deployment_name}_*.log")
        if any(request_id in path.read_text(errors="replace") for request_id in request_ids)
    ]


async def _both_replicas_logged(answering: DeploymentName, request_ids: list[str]) -> bool:
    return len(await asyncio.to_thread(_logs_naming, answering, request_ids)) == 2


def _check_no_key_is_logged(app) -> None:
    session_logs = _session_logs()
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


async def _none_alive(deployment: DeploymentName, replicas: set[str]) -> bool:
    return not replicas & set(await live_replicas(deployment))


async def _replaced(handle) -> bool:
    """Once replacing: the new replica running and nothing starting (the old one drains while its answers last)."""
    states = await replica_states(handle)
    return states.get("RUNNING") == 1 and "STARTING" not in states


async def test_two_replicas_answering_clients_together_enforce_each_keys_rate_limits(variants):
    """Two model replicas answer clients, each its own front door, and a key's limits hold across both,
    kept by the RateLimiter's two replicas (the shipped default): each key's calls all reach one of
    them (calls spread over both would admit up to twice the limit)."""
    limited = await ready_bed(variants["glm-rate-limited"], replicas=2)
    app, answering = limited.app, limited.model
    limiter = DeploymentName(app.name, "rate-limiter")
    await wait_until(lambda: _exactly_running(limiter, 2), 60, "the limiter's two replicas running")
    assert await _accepts(app.url, LIMITED_KEYS[0])

    await _check_requests_per_minute(app, answering)
    await _check_tokens_per_minute(app)


async def _exactly_running(deployment: DeploymentName, count: int) -> bool:
    return await replica_states(deployment) == {"RUNNING": count}


async def _check_requests_per_minute(app, answering: DeploymentName) -> None:
    """Sent at once through both answering replicas, twice the limit: the limit gets through, plus
    what the key's bucket refilled while they were answered (a minute's worth, refilling
    continuously: configuration.md), and no more (each replica alone would admit the whole limit)."""
    key = bearer(LIMITED_KEYS[0])
    started = time.monotonic()
    request_ids = [f"rate-limit-check-{uuid.uuid4()}" for _ in range(2 * REQUESTS_PER_MINUTE)]

    async def one(request_id: str) -> httpx.Response:
        headers = key | {"X-Request-Id": request_id}  # Serve logs it as the request's id
        async with httpx.AsyncClient(base_url=app.url, timeout=120, headers=headers) as client:
            return await client.post("/v1/chat/completions", json=chat(app.model, 1))

    responses = await asyncio.gather(*(one(request_id) for request_id in request_ids))
    # Serve writes each replica's access line as the answer ends: wait for them to land.
    await wait_until(
        lambda: _both_replicas_logged(answering, request_ids), 30, "the requests logged by both answering replicas"
    )
    refilled = math.floor((time.monotonic() - started) * REQUESTS_PER_MINUTE / 60)
    statuses = sorted(r.status_code for r in responses)
    admitted = statuses.count(200)
    assert set(statuses) == {200, 429}, statuses
    # Each replica alone would admit the whole limit: twice it, here.
    assert REQUESTS_PER_MINUTE <= admitted <= REQUESTS_PER_MINUTE + refilled, statuses
    refused = [r for r in responses if r.status_code == 429]
    for response in refused:
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "requests per minute" in error["message"] and "sk-e2e" not in response.text
    retry_after = max(int(r.headers["retry-after"]) for r in refused)
    assert 1 <= retry_after <= math.ceil(60 / REQUESTS_PER_MINUTE)
    await asyncio.sleep(retry_after)  # what the server told the client to do
    response = httpx.post(f"{app.url}/v1/chat/completions", json=chat(app.model, 1), headers=key, timeout=60)
    assert response.status_code == 200, response.text


async def _check_tokens_per_minute(app) -> None:
    """Streams are charged the tokens they used (without sending the client a usage chunk it
    did not ask for), and once a minute's tokens are spent the key is told to wait."""
    tokens_each = 300
    async with httpx.AsyncClient(base_url=app.url, timeout=120, headers=bearer(LIMITED_KEYS[1])) as client:
        admitted, started = 0, time.monotonic()
        while True:
            stream = await post_stream(client, "/v1/chat/completions", chat(app.model, tokens_each, stream=True))
            if stream.status != 200:
                break
            assert stream.done and not any("usage" in chunk for chunk in stream.chunks)
            admitted += 1
            available = TOKENS_PER_MINUTE * (1 + (time.monotonic() - started) / 60)
            # A request is admitted while the bucket is above zero, and a stream is charged once it
            # has ended, after its [DONE]: the next request may be admitted before the last charge lands.
            charged_before = admitted - 2  # at least: every stream but the last
            assert charged_before * tokens_each < available, f"streams were not charged their tokens: {admitted}"
    assert stream.status == 429
    # Each stream used its prompt and 300 tokens: 4 reach the limit (a 5th may start before the 4th is charged).
    assert admitted >= math.ceil(TOKENS_PER_MINUTE / (tokens_each + 100)), admitted
    # (That the key is admitted again after its Retry-After is the requests-per-minute check's.)
    assert int(stream.headers["retry-after"]) >= 1
