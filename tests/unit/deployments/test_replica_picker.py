"""What the replica picker reads of a body HAProxy forwards, and what it routes by load."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest

from serve_app.config import APIKeysConfig
from serve_app.deployments import replica_picker
from serve_app.deployments.replica_picker import ANY_CLIENT, accepted_key, picker_keys, routing_of
from serve_app.deployments.replica_picker import routing_request as read_routing_request
from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.cache_salt import key_cache_salt
from serve_app.front_door.admission.json_body import MAX_CONTAINERS
from serve_app.routing.prompt_text import PromptRenderer
from serve_app.serve_internals import ReplicaEndpoint


def routing_request(body: bytes) -> tuple[str, Any]:
    """The method and request the picker routes by; fails the test if it would route by load."""
    parsed = read_routing_request(body)
    assert parsed is not None
    return parsed


def rendered(request: Any) -> str:
    prompt = PromptRenderer(TEMPLATE).render(request)
    assert prompt is not None
    return prompt.text


TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|a|>{% endif %}"
)


def test_a_chat_body_is_routed_as_a_chat_with_the_fields_the_prefix_router_renders() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    method, request = routing_request(json.dumps(body).encode())
    assert method == "chat"
    # The prefix router renders it as it renders a validated request.
    assert rendered(request) == "<|user|>hi<|a|>"


def test_a_chat_bodys_own_template_arguments_and_tools_are_kept() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
        "add_generation_prompt": False,
    }
    _, request = routing_request(json.dumps(body).encode())
    assert request.tool_choice == "none" and request.add_generation_prompt is False
    assert rendered(request) == "<|user|>hi"


def test_a_completion_body_is_routed_as_a_completion() -> None:
    method, request = routing_request(b'{"model": "m", "prompt": "Once upon"}')
    assert method == "completion"
    assert rendered(request) == "Once upon"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'"text"',
        b'{"model": "m"}',
        b'{"messages": "not a list"}',
        b"\xff\xfe",
        # Nested past the parser's recursion limit (RecursionError, not ValueError): the
        # hostile-body case the replica answers with a 400.
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}",
        # More arrays and objects than the front door parses: refused unparsed (the replica's 400).
        b'{"messages": [{"role": "user", "content": "hi"}], "metadata": [' + b"[]," * MAX_CONTAINERS + b"[]]}",
    ],
    ids=[
        "empty",
        "not json",
        "a list",
        "a string",
        "no prompt",
        "messages not a list",
        "not utf-8",
        "too deep",
        "too many containers",
    ],
)
def test_a_body_with_no_prompt_to_read_is_routed_by_load(body: bytes) -> None:
    assert read_routing_request(body) is None


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
KEY = "sk-alpha-0123456789ab"


def keys() -> APIKeys:
    return APIKeys("test keys", read=lambda: KEY + "\n")


class Body:
    """The request's body as Starlette's ``request.body``, counting whether it was read."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reads = data, 0

    async def __call__(self) -> bytes:
        self.reads += 1
        return self.data


class Picks:
    """Stands in for serve_internals' two ways to name a replica, counting each."""

    def __init__(self) -> None:
        self.routed: list[tuple[Any, ...]] = []  # routing passes (the handle's router), with what they read
        self.at_random = 0  # replicas named from the router's list, with no pass

    async def pick_replica(self, handle: Any, *routing_args: Any) -> ReplicaEndpoint:
        self.routed.append(routing_args)
        return ReplicaEndpoint("10.0.0.1", 8001, "routed")

    def any_replica(self, handle: Any) -> ReplicaEndpoint:
        self.at_random += 1
        return ReplicaEndpoint("10.0.0.2", 8002, "at-random")


class Request:
    """What ``ReplicaPicker.route`` reads of Starlette's request."""

    def __init__(self, headers: dict[str, str], body: Body) -> None:
        self.headers, self.body = headers, body


async def route(
    monkeypatch: pytest.MonkeyPatch,
    api_keys: APIKeys | None,
    headers: dict[str, str],
    body: Body,
    isolate_prefix_cache: bool = False,
):
    """``ReplicaPicker.route`` for one request: the replica it names, and how it named it."""
    picks = Picks()
    monkeypatch.setattr(replica_picker, "pick_replica", picks.pick_replica)
    monkeypatch.setattr(replica_picker, "any_replica", picks.any_replica)
    handles = {"chat": "chat handle", "completion": "completion handle"}
    picker = SimpleNamespace(keys=api_keys, handles=handles, isolate_prefix_cache=isolate_prefix_cache)
    picker_class = cast(Any, replica_picker.ReplicaPicker).func_or_class  # (the class Serve's deployment wraps)
    response = await picker_class.route(picker, Request(headers, body))
    return json.loads(response.body)["replica_id"], picks


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer sk-not-a-configured-key-0"}, {"authorization": KEY}],
    ids=["no key", "a wrong key", "not a bearer token"],
)
async def test_without_an_accepted_key_the_body_is_never_read_nor_routed(monkeypatch, headers) -> None:
    """A replica from the router's list, no routing pass: the cost of a refused request is the key check."""
    body = Body(CHAT)
    replica, picks = await route(monkeypatch, keys(), headers, body)
    assert (replica, picks.at_random, picks.routed, body.reads) == ("at-random", 1, [], 0)


async def test_with_an_accepted_key_the_prompt_is_read_and_routed(monkeypatch) -> None:
    body = Body(CHAT)
    replica, picks = await route(monkeypatch, keys(), {"authorization": f"Bearer {KEY}"}, body)
    (routing_args,) = picks.routed
    assert replica == "routed" and picks.at_random == 0 and body.reads == 1
    assert routing_args[0].messages == [{"role": "user", "content": "hi"}]


async def test_with_each_keys_cache_apart_a_prompt_is_routed_under_its_keys_salt(monkeypatch) -> None:
    """The router keys the prompt as the engine caches it: under the salt the key's front door gives it."""
    headers = {"authorization": f"Bearer {KEY}"}
    key_id = keys().identify(KEY)
    assert key_id is not None
    _, picks = await route(monkeypatch, keys(), headers, Body(CHAT), isolate_prefix_cache=True)
    assert picks.routed[0][0].cache_salt == key_cache_salt(key_id)
    own_salt = json.dumps({"model": "m", "prompt": "hi", "cache_salt": "user-7"}).encode()
    _, picks = await route(monkeypatch, keys(), headers, Body(own_salt), isolate_prefix_cache=True)
    assert picks.routed[0][0].cache_salt == key_cache_salt(key_id, "user-7")
    not_a_salt = json.dumps({"model": "m", "prompt": "hi", "cache_salt": [1]}).encode()  # (the replica's 400)
    _, picks = await route(monkeypatch, keys(), headers, Body(not_a_salt), isolate_prefix_cache=True)
    assert picks.routed[0][0].cache_salt == key_cache_salt(key_id)
    _, picks = await route(monkeypatch, keys(), headers, Body(CHAT))  # the keys trust each other
    assert getattr(picks.routed[0][0], "cache_salt", None) is None


async def test_without_keys_configured_every_request_is_read(monkeypatch) -> None:
    body = Body(CHAT)
    replica, picks = await route(monkeypatch, None, {}, body)
    assert replica == "routed" and len(picks.routed[0]) == 1 and body.reads == 1


async def test_a_body_haproxy_cut_at_its_buffer_goes_by_load_unread(monkeypatch) -> None:
    body = Body(CHAT[:10])
    headers = {"authorization": f"Bearer {KEY}", "x-body-truncated": "10/300000"}
    replica, picks = await route(monkeypatch, keys(), headers, body)
    assert (replica, picks.routed, body.reads) == ("routed", [()], 0)
    assert await routing_of(headers, body) is None


def test_accepted_key_is_the_front_doors_own_key_check() -> None:
    assert accepted_key(None, {}) == ANY_CLIENT
    assert accepted_key(keys(), {"authorization": f"Bearer {KEY}"}) == keys().identify(KEY)
    assert accepted_key(keys(), {"authorization": "Bearer " + KEY[:-1] + "x"}) is None


async def test_where_the_keys_cannot_be_read_the_picker_still_routes_every_request_unread(monkeypatch, tmp_path):
    """A picker on a pod without the keys' Secret starts, and reads no body (each goes to any replica)."""
    keys = picker_keys(APIKeysConfig(file=str(tmp_path / "absent")))
    body = Body(CHAT)
    replica, picks = await route(monkeypatch, keys, {"authorization": f"Bearer {KEY}"}, body)
    assert (replica, picks.routed, body.reads) == ("at-random", [], 0)
