"""Per-key rate limits: the ledger's arithmetic, the front door's 429s, and token counting.

The shared limiter is a Ray Serve deployment in the app; here a fake handle calls
the same :class:`RateLedger` in process, with a clock the test moves. The real
limiter, shared by two model replicas, is proven in tests/e2e/test_rollout.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app.config import AppConfig, ConfigError, parse_app_config
from serve_app.deployments.rate_limiter import RateLedger
from serve_app.engine.stream_transforms import OutcomeTap
from serve_app.errors import APIError
from serve_app.front_door.admission import rate_limits
from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.rate_limits import Decision, KeyLimits, rate_limited
from serve_app.protocol import Outcome, WholeAnswer
from tests.openai_errors import assert_openai_error
from tests.unit.front_door.fakes import CHAT, KEYS, LedgerHandle, client_for
from tests.waiting import wait_until


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- the ledger -------------------------------------------------------------------------------


def test_a_key_bursts_to_its_requests_per_minute_then_waits_for_one_to_refill():
    ledger = RateLedger(requests_per_minute=3, tokens_per_minute=None)
    assert [ledger.admit("a", now=0.0).allowed for _ in range(3)] == [True, True, True]
    refused = ledger.admit("a", now=0.0)
    assert refused == Decision(False, "requests per minute", pytest.approx(20.0))
    assert not ledger.admit("a", now=19.0).allowed
    assert ledger.admit("a", now=20.0).allowed  # one request refilled after 60/3 s
    assert ledger.admit("b", now=20.0).allowed  # another key has its own bucket


def test_tokens_are_charged_after_the_answer_and_admission_waits_until_the_bucket_is_positive():
    ledger = RateLedger(requests_per_minute=None, tokens_per_minute=600)  # 10 tokens/s
    assert ledger.admit("a", now=0.0).allowed
    ledger.charge("a", 700, now=0.0)  # an answer larger than what was left
    refused = ledger.admit("a", now=0.0)
    assert refused.limit == "tokens per minute" and refused.retry_after_s == pytest.approx(10.1)
    assert not ledger.admit("a", now=10.0).allowed  # level 0: still empty
    assert ledger.admit("a", now=10.2).allowed


def test_token_debt_is_capped_at_one_bucket():
    ledger = RateLedger(requests_per_minute=None, tokens_per_minute=60)
    ledger.charge("a", 10_000, now=0.0)
    assert ledger.admit("a", now=0.0).retry_after_s == pytest.approx(61.0)  # from -60 up to 1


def test_the_longer_wait_of_two_limits_is_reported():
    ledger = RateLedger(requests_per_minute=1, tokens_per_minute=60)
    assert ledger.admit("a", now=0.0).allowed
    ledger.charge("a", 90, now=0.0)
    refused = ledger.admit("a", now=0.0)
    assert refused.limit == "requests per minute" and refused.retry_after_s == pytest.approx(60.0)


def test_idle_keys_are_forgotten_once_their_buckets_are_full():
    ledger = RateLedger(requests_per_minute=60, tokens_per_minute=60)
    ledger.admit("a", now=0.0)
    ledger.charge("a", 30, now=0.0)
    ledger.admit("b", now=100.0)  # a's buckets refilled long ago
    assert set(ledger.requests) == {"b"} and set(ledger.tokens) == {"b"}


def test_retry_after_is_whole_seconds_and_at_least_one():
    assert rate_limited(Decision(False, "requests per minute", 0.2)).headers == {"Retry-After": "1"}
    error = rate_limited(Decision(False, "tokens per minute", 7.01))
    assert error.status == 429 and error.headers == {"Retry-After": "8"} and error.code == "rate_limit_exceeded"
    assert "tokens per minute" in error.message


def test_a_key_holds_at_most_its_concurrent_requests_each_lease_given_back_or_expired():
    ledger = RateLedger(requests_per_minute=None, tokens_per_minute=None, max_concurrent=2)
    assert ledger.admit("a", "l1", 100.0, now=0.0).allowed and ledger.admit("a", "l2", 100.0, now=0.0).allowed
    refused = ledger.admit("a", "l3", 100.0, now=0.0)
    assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "requests at once", 1.0)
    assert ledger.admit("b", "l4", 100.0, now=0.0).allowed  # another key has its own places
    ledger.release("a", "l1")
    assert ledger.admit("a", "l5", 100.0, now=1.0).allowed
    assert not ledger.admit("a", "l6", 100.0, now=99.0).allowed
    assert ledger.admit("a", "l7", 100.0, now=100.0).allowed  # l2, never given back, expired
    ledger.release("a", "unknown")  # (given back twice, or after it expired: no effect)
    assert set(ledger.leases["a"]) == {"l5", "l7"}


def test_a_renewed_lease_lives_on_and_a_renewal_never_takes_a_place():
    ledger = RateLedger(requests_per_minute=None, tokens_per_minute=None, max_concurrent=1)
    assert ledger.admit("a", "l1", 30.0, now=0.0).allowed
    ledger.renew("a", ["l1", "never-taken"], 30.0, now=20.0)
    assert ledger.leases["a"] == {"l1": 50.0}
    assert not ledger.admit("a", "l2", 30.0, now=45.0).allowed  # still held: renewed
    assert ledger.admit("a", "l3", 30.0, now=50.0).allowed  # not renewed again: gone at 50
    ledger.renew("b", ["l9"], 30.0, now=50.0)  # a key holding nothing
    assert "b" not in ledger.leases


def test_expired_leases_of_keys_that_never_come_back_are_purged():
    ledger = RateLedger(requests_per_minute=None, tokens_per_minute=None, max_concurrent=2)
    assert ledger.admit("gone", "l1", 30.0, now=0.0).allowed
    assert ledger.admit("b", "l2", 30.0, now=100.0).allowed  # any admission, a minute on
    assert set(ledger.leases) == {"b"}


def test_a_refused_request_takes_no_lease_and_no_request_from_the_bucket():
    ledger = RateLedger(requests_per_minute=2, tokens_per_minute=None, max_concurrent=1)
    assert ledger.admit("a", "l1", 100.0, now=0.0).allowed
    assert not ledger.admit("a", "l2", 100.0, now=0.0).allowed
    assert ledger.requests["a"].level == 1 and set(ledger.leases["a"]) == {"l1"}


# --- the front door's side -------------------------------------------------------------------


def limited_client(items: list[Any], limiter: LedgerHandle, counts_tokens: bool = False, then=()):
    keys = APIKeys("test keys", lambda: KEYS)
    return client_for(items, api_keys=keys, key_limits=KeyLimits(limiter, counts_tokens), then=then)


def test_past_its_limit_a_key_gets_429_with_retry_after_and_other_keys_do_not():
    limiter = LedgerHandle(RateLedger(requests_per_minute=2, tokens_per_minute=None))
    client, handle = limited_client([WholeAnswer(200, b"{}")], limiter)
    alpha, beta = bearer("sk-alpha-0123456789ab"), bearer("sk-beta-0123456789abc")
    assert [client.post("/v1/chat/completions", json=CHAT, headers=alpha).status_code for _ in range(2)] == [200, 200]
    refused = client.post("/v1/chat/completions", json=CHAT, headers=alpha)
    error = assert_openai_error(refused, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert refused.headers["retry-after"] == "30"
    assert client.post("/v1/chat/completions", json=CHAT, headers=beta).status_code == 200
    assert len(handle.payloads) == 3  # the refused request never reached a replica
    assert all(key_id not in KEYS and len(key_id) == 16 for key_id in limiter.ledger.requests)
    limiter.now = 30.0
    assert client.post("/v1/chat/completions", json=CHAT, headers=alpha).status_code == 200


def test_a_key_past_its_limit_gets_its_429_before_any_work_its_body_would_cost():
    """The limits come first: a body never parsed, checked or built a grammar for (here one that
    would be a 400) still gets the key's 429, and counts against its limit."""
    limiter = LedgerHandle(RateLedger(requests_per_minute=1, tokens_per_minute=None))
    client, handle = limited_client([WholeAnswer(200, b"{}")], limiter)
    alpha = bearer("sk-alpha-0123456789ab") | {"Content-Type": "application/json"}
    not_json = client.post("/v1/chat/completions", content=b"{not json", headers=alpha)
    assert_openai_error(not_json, 400)  # within the limit: counted, then refused for what it is
    refused = client.post("/v1/chat/completions", content=b"{not json", headers=alpha)
    assert assert_openai_error(refused, 429)["code"] == "rate_limit_exceeded"
    assert handle.payloads == []


def test_an_unreachable_limiter_admits_requests():
    client, _ = limited_client([WholeAnswer(200, b"{}")], LedgerHandle(fail=ConnectionError("gone")))
    assert client.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-alpha-0123456789ab")).status_code == 200


async def test_concurrent_requests_are_counted_at_the_limiter_and_given_back_there():
    limiter = LedgerHandle(RateLedger(requests_per_minute=None, tokens_per_minute=None, max_concurrent=1))
    limits = KeyLimits(limiter, counts_tokens=False, max_concurrent=1, lease_s=30.0)
    lease = await limits.admit("a")
    assert lease is not None and lease.at_limiter and limits.held == {"a": 1}
    with pytest.raises(APIError) as refused:
        await limits.admit("a")
    assert (refused.value.status, refused.value.headers) == (429, {"Retry-After": "1"})
    assert "requests at once" in refused.value.message
    limits.ended(lease)
    await asyncio.gather(*limits._calls)  # the release, sent in the background
    assert limits.held == {} and limiter.ledger.leases == {}
    assert await limits.admit("a") is not None


async def test_every_call_names_its_key_as_the_session_the_limiters_router_keeps_together():
    """Ray's consistent-hash router sends calls of one session id to one limiter replica: each key's
    admissions, charges and releases must carry the key, or its counts would split."""
    limiter = LedgerHandle(RateLedger(requests_per_minute=10, tokens_per_minute=100, max_concurrent=2))
    limits = KeyLimits(limiter, counts_tokens=True, max_concurrent=2, lease_s=30.0)
    leases = [await limits.admit("a"), await limits.admit("b")]
    limits.charge("a", 7)
    for lease in leases:
        assert lease is not None
        limits.ended(lease)
    await asyncio.gather(*limits._calls)
    assert sorted(limiter.sessions) == [
        ("a", "admit", "a"),
        ("a", "charge", "a"),
        ("a", "release", "a"),
        ("b", "admit", "b"),
        ("b", "release", "b"),
    ]


async def test_while_the_limiter_is_unreachable_each_replica_holds_a_key_to_the_limit_itself():
    limiter = LedgerHandle(fail=ConnectionError("gone"))
    limits = KeyLimits(limiter, counts_tokens=False, max_concurrent=2)
    leases = [await limits.admit("a"), await limits.admit("a")]
    assert all(lease is not None and not lease.at_limiter for lease in leases)
    with pytest.raises(APIError):
        await limits.admit("a")
    assert await limits.admit("b") is not None  # another key has its own count
    for lease in leases:
        assert lease is not None
        limits.ended(lease)
    assert limits.held == {"b": 1}
    # Given back there too: the limiter may have taken a lease whose answer never came.
    await asyncio.gather(*limits._calls)
    assert [method for _, method, _ in limiter.sessions].count("release") == 2
    assert await limits.admit("a") is not None


class LateLimiter(LedgerHandle):
    """A limiter whose answers come after the front door stopped waiting, though it took the lease."""

    def call(self, name: str, *args: Any) -> Any:
        if name != "admit":
            return super().call(name, *args)
        taken = asyncio.get_running_loop().create_future()
        ledger = self.ledger
        assert ledger is not None

        async def answer_late() -> None:
            await asyncio.sleep(0.05)  # (the limiter's answer, slower than the front door's wait)
            decision = ledger.admit(*args, now=self.now)  # taken, whoever still waits for it
            if not taken.done():
                taken.set_result(decision)

        self.late = asyncio.get_running_loop().create_task(answer_late())
        return taken


async def test_a_lease_the_limiter_took_after_the_front_door_stopped_waiting_is_renewed_and_given_back(
    monkeypatch,
):
    monkeypatch.setattr(rate_limits, "LIMITER_TIMEOUT_S", 0.01)
    monkeypatch.setattr(rate_limits, "RENEW_EVERY_S", 0.01)
    limiter = LateLimiter(RateLedger(requests_per_minute=None, tokens_per_minute=None, max_concurrent=1))
    limits = KeyLimits(limiter, counts_tokens=False, max_concurrent=1)
    lease = await limits.admit("a")
    assert lease is not None and not lease.at_limiter
    await limiter.late
    assert limiter.ledger is not None and set(limiter.ledger.leases["a"]) == {lease.lease_id}  # taken there after all

    async def renewed() -> bool:
        return ("a", "renew", "a") in limiter.sessions

    await wait_until(renewed, 5, "the lease renewed while its request runs")
    limits.ended(lease)
    await asyncio.gather(*limits._calls)
    assert limiter.ledger.leases == {} and limits.leases == {}
    await wait_until(lambda: limits._renewer is not None and limits._renewer.done(), 5, "renewals stopped")


def test_a_requests_place_is_given_back_when_it_ends_whatever_its_answer():
    """The lease is the record's: given back by the request's end, a refusal by the replica included."""
    limiter = LedgerHandle(fail=ConnectionError("gone"))  # this replica's own count, kept in step
    limits = KeyLimits(limiter, counts_tokens=False, max_concurrent=1)
    keys = APIKeys("test keys", lambda: KEYS)
    client, _ = client_for(
        [WholeAnswer(200, b"{}")],
        then=[[WholeAnswer.error(400, "too long a prompt", "messages")], [WholeAnswer(200, b"{}")]],
        api_keys=keys,
        key_limits=limits,
    )
    key = bearer("sk-alpha-0123456789ab")
    statuses = [client.post("/v1/chat/completions", json=CHAT, headers=key).status_code for _ in range(3)]
    assert statuses == [200, 400, 200] and limits.held == {}
    asyncio.run(limits.admit(keys.identify("sk-alpha-0123456789ab") or ""))  # the key's one place, held
    refused = client.post("/v1/chat/completions", json=CHAT, headers=key)
    assert assert_openai_error(refused, 429)["code"] == "rate_limit_exceeded"


def test_unary_answers_are_charged_their_usage():
    limiter = LedgerHandle(RateLedger(requests_per_minute=None, tokens_per_minute=100))
    client, handle = limited_client([WholeAnswer(200, b"{}", Outcome(30, 90))], limiter, counts_tokens=True)
    key = bearer("sk-alpha-0123456789ab")
    assert client.post("/v1/chat/completions", json=CHAT, headers=key).status_code == 200
    assert [tokens for _, tokens in limiter.charged] == [120]
    assert client.post("/v1/chat/completions", json=CHAT, headers=key).status_code == 429


def test_a_streams_usage_item_is_charged_and_never_written():
    limiter = LedgerHandle(RateLedger(requests_per_minute=None, tokens_per_minute=1000))
    chunks = ['data: {"choices":[{"text":"a"}]}\n\n', "data: [DONE]\n\n", Outcome(5, 7)]
    client, _ = limited_client(chunks, limiter, counts_tokens=True)
    body = {**CHAT, "stream": True}
    response = client.post("/v1/chat/completions", json=body, headers=bearer("sk-alpha-0123456789ab"))
    assert response.text == 'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    assert [tokens for _, tokens in limiter.charged] == [12]


def test_without_token_limits_nothing_is_charged():
    limiter = LedgerHandle(RateLedger(requests_per_minute=10, tokens_per_minute=None))
    client, handle = limited_client([WholeAnswer(200, b"{}", Outcome(1, 1))], limiter)
    client.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-alpha-0123456789ab"))
    assert len(handle.payloads) == 1 and limiter.charged == []


# --- usage from vLLM's stream ----------------------------------------------------------------

USAGE_CHUNK = 'data: {"id":"x","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}}\n\n'
TOKEN_CHUNK = 'data: {"id":"x","choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
LAST_CHUNK = 'data: {"id":"x","choices":[{"index":0,"text":"!","finish_reason":"length"}]}\n\n'


async def _tapped(tap: OutcomeTap, chunks: tuple[str, ...]) -> list[str]:
    async def stream():
        for chunk in chunks:
            yield chunk

    return [chunk async for chunk in tap.tap(stream())]


def test_the_usage_chunk_is_taken_out_unless_the_client_asked_for_it():
    chunks = (TOKEN_CHUNK, LAST_CHUNK, USAGE_CHUNK, "data: [DONE]\n\n")
    unasked = OutcomeTap(client_asked_usage=False)
    assert asyncio.run(_tapped(unasked, chunks)) == [TOKEN_CHUNK, LAST_CHUNK, "data: [DONE]\n\n"]
    assert unasked.outcome == Outcome(4, 6, ("length",)) and unasked.outcome.total_tokens == 10
    asked = OutcomeTap(client_asked_usage=True)
    assert asyncio.run(_tapped(asked, chunks)) == list(chunks)
    assert asked.outcome == Outcome(4, 6, ("length",))


def test_a_stream_cut_short_or_with_a_broken_usage_chunk_has_no_outcome():
    cut = OutcomeTap(client_asked_usage=False)
    asyncio.run(_tapped(cut, (TOKEN_CHUNK,)))
    assert cut.outcome is None
    broken = OutcomeTap(client_asked_usage=False)
    asyncio.run(_tapped(broken, (TOKEN_CHUNK, 'data: {"choices":[],"usage":{"prompt_tokens":"x"}}\n\n')))
    assert broken.outcome is None


# --- configuration ---------------------------------------------------------------------------


def config_with(ingress: dict[str, Any]) -> AppConfig:
    model = {"name": "m", "engine_args": {"model": "x", "max_num_seqs": 8}}
    return parse_app_config({"models": [model], "ingress": ingress})


def test_rate_limits_need_api_keys_and_at_least_one_limit():
    keys = {"env": "KEYS"}
    assert config_with({"api_keys": keys, "rate_limits": {"requests_per_minute": 5}}).ingress.rate_limits
    with pytest.raises(ConfigError, match="set ingress.api_keys"):
        config_with({"rate_limits": {"requests_per_minute": 5}})
    with pytest.raises(ConfigError, match="requests_per_minute, tokens_per_minute, max_concurrent_requests or several"):
        config_with({"api_keys": keys, "rate_limits": {}})
    with pytest.raises(ConfigError, match="set num_replicas"):
        scaled = {"tokens_per_minute": 5, "deployment": {"autoscaling_config": {}}}
        config_with({"api_keys": keys, "rate_limits": scaled})
