"""ReplicaPicker: the deployment HAProxy asks which model replica takes a request. Runs in its own replicas.

For each POST to the application, Serve's HAProxy posts the first
``RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE`` bytes of the request's body to one
ReplicaPicker replica (``/internal/route``, round robin over them), with the client's
``Authorization`` header (deploy/cluster.env names it Serve's session header, the one
header Serve's Lua action passes on), then forwards the client's connection to the model
replica it names; the answer streams from that replica to HAProxy to the client and never
passes through here. The pick is the model deployment's own request router (prefix-aware
routing when the model turns it on, else Serve's power of two choices), run here for HAProxy.

Nothing a client sends before its key is checked costs more than that check: a request
without an accepted key (when keys are configured) goes to a replica taken at random from the
router's list, with no routing pass and its body unread, so its prompt never reaches the
router's table; the replica answers it 401. With each key's prompts cached apart (the
default where keys are set), a request's prompt is keyed by its key's ``cache_salt``, as the
engine caches it. A body cut at
the buffer's size, one that nests or counts arrays and objects past the front door's bounds,
or one that is not JSON or names no prompt, is routed by load too.

It refuses nothing: HAProxy turns any answer but 200 into its own 503 page, which is
not an OpenAI error; the chosen replica's front door gives the client its 4xx.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import SimpleNamespace
from typing import Any, Protocol

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.config import APIKeysConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.auth import APIKeysUnavailable, bearer_token, load_api_keys
from serve_app.front_door.admission.cache_salt import key_cache_salt
from serve_app.front_door.admission.json_body import MAX_NESTING, check_structure
from serve_app.serve_internals import BODY_TRUNCATED_HEADER, ROUTE_PATH, any_replica, pick_replica, pick_replica_id

logger = logging.getLogger("ray.serve")


def routing_request(body: bytes) -> tuple[str, Any] | None:
    """The replica method a body is for and what the request router reads of it; None to route by load.

    The router reads a chat's ``messages``, ``tools``, ``tool_choice`` and template
    arguments, a completion's ``prompt``, or a Responses API request's ``instructions``,
    ``input`` and tools (:mod:`serve_app.routing.prompt_text`),
    as attributes: the parsed body, not yet validated, offers them as a namespace.
    The body is held to the front door's structure bounds before it is parsed.
    """
    if not body:
        return None
    try:
        if body.count(b"[") + body.count(b"{") > MAX_NESTING:  # only then can it pass a bound
            check_structure(body)
        fields = json.loads(body)
    except (APIError, ValueError, RecursionError):  # the replica's 400
        return None
    if not isinstance(fields, dict):
        return None
    if isinstance(fields.get("messages"), list):
        chat = {"tools": None, "tool_choice": None, "chat_template_kwargs": None, "add_generation_prompt": True}
        return "chat", SimpleNamespace(**(chat | fields))
    if "prompt" in fields:
        return "completion", SimpleNamespace(**fields)
    if isinstance(fields.get("input"), str | list):  # the Responses API's: rendered as a chat
        return "responses", SimpleNamespace(**fields)
    return None


class KeyCheck(Protocol):
    """What the picker asks of the front door's keys (:class:`~serve_app.front_door.admission.auth.APIKeys`)."""

    def identify(self, key: str) -> str | None: ...


class NoKeyAccepted:
    """The keys where they cannot be read (a pod without the keys' Secret): no request's body is read."""

    def identify(self, key: str) -> str | None:
        return None


def picker_keys(config: APIKeysConfig | None) -> KeyCheck | None:
    """The keys the front door accepts (None: none configured, every body may be read). Where the
    configured keys cannot be read in the picker's process, it still routes every request, by load,
    its body unread: a picker that refused to start would leave HAProxy no picker to ask."""
    try:
        return load_api_keys(config)
    except APIKeysUnavailable as exc:
        logger.error("ReplicaPicker: %s; every request is routed by load, its body unread", exc)
        return NoKeyAccepted()


async def routing_of(headers: Mapping[str, str], body: Callable[[], Awaitable[bytes]]) -> tuple[str, Any] | None:
    """What the request router reads of a request whose key the front door accepts (None: route by load).

    ``body`` is read only if HAProxy forwarded it whole.
    """
    if BODY_TRUNCATED_HEADER in headers:
        return None
    return routing_request(await body())


ANY_CLIENT = ""  # the "key" of every request where no keys are configured


def accepted_key(keys: KeyCheck | None, headers: Mapping[str, str]) -> str | None:
    """The id of the request's key if the front door accepts it (:data:`ANY_CLIENT` for every
    request, when no keys are set); None: no accepted key."""
    if keys is None:
        return ANY_CLIENT
    token = bearer_token(headers)
    return None if token is None else keys.identify(token)


def salted(routing_args: Any, key_id: str) -> Any:
    """The parsed request under the ``cache_salt`` its key's front door gives it
    (:mod:`serve_app.front_door.admission.cache_salt`), so that the router keys its prompt as the engine caches it."""
    sent = getattr(routing_args, "cache_salt", None)  # (unvalidated: the replica's 400 if not a string)
    routing_args.cache_salt = key_cache_salt(key_id, sent if isinstance(sent, str) else None)
    return routing_args


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    # On every request's path: it must never be what holds requests back.
    max_ongoing_requests=1000,
    # Any change to the application's arguments replaces it (they are its code version): its
    # successor starts before it stops (app.py also keeps it answering while it stops). Without
    # a surge Serve stopped it first, and HAProxy had no picker to ask for seconds.
    max_surge_percent=100,
    # No access line per pick: the model replica logs each request, and writing a line was an
    # eighth of the picker's CPU per request (py-spy, unauthenticated bodies: docs/performance-history.md).
    logging_config={"enable_access_log": False},
)
@serve.ingress()
class ReplicaPicker:
    """Names the model replica for each request HAProxy asks about, or (a bare ``serve run``, no
    HAProxy) each request a model replica received: :meth:`pick`."""

    def __init__(
        self, model: DeploymentHandle | str, api_keys: APIKeysConfig | None = None, isolate_prefix_cache: bool = False
    ) -> None:
        """``api_keys``: the keys the front door accepts (the config's ``ingress.api_keys``);
        ``isolate_prefix_cache``: each key's prompts are cached apart (``ingress.isolates_prefix_cache``)."""
        self.keys = picker_keys(api_keys)
        self.isolate_prefix_cache = isolate_prefix_cache and api_keys is not None
        if isinstance(model, str):  # the model deployment's name: it holds a handle to this one
            model = serve.get_deployment_handle(model, serve.get_replica_context().app_name)
        # One handle per generation method, made once (not per request); each builds its own
        # request router, so chat and completion prompts are remembered apart. A Responses API
        # request renders as a chat, and is routed with chats: the same conversation, the same cache.
        handles = {method: model.options(method_name=method) for method in ("chat", "completion")}
        self.handles = handles | {"responses": handles["chat"]}

    async def pick(self, method: str, request: Any) -> str:
        """The full id of the replica the router picks for a parsed request of the model's ``method``."""
        return await pick_replica_id(self.handles[method], request)

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[Route(ROUTE_PATH, self.route, methods=["POST"])])

    async def route(self, request: Request) -> Response:
        if (key_id := accepted_key(self.keys, request.headers)) is None:
            # Any replica answers it 401 alike: one from the router's list, with no routing pass.
            handle = self.handles["chat"]
            endpoint = any_replica(handle) or await pick_replica(handle)
        elif (parsed := await routing_of(request.headers, request.body)) is None:
            endpoint = await pick_replica(self.handles["chat"])
        else:
            method, routing_args = parsed
            if self.isolate_prefix_cache:
                routing_args = salted(routing_args, key_id)
            endpoint = await pick_replica(self.handles[method], routing_args)
        return JSONResponse({"host": endpoint.host, "port": endpoint.port, "replica_id": endpoint.replica_id})
