"""API keys: when configured, every ``/v1/*`` request needs ``Authorization: Bearer <key>``
(a gRPC call, the same ``authorization`` metadata).

Keys come from an environment variable or a file, either of which a Kubernetes
Secret fills, one key per line (see :func:`parse_keys`). A file is re-read when
it changes, so rotating the Secret takes effect without restarting anything
(Kubernetes swaps a mounted Secret's files atomically; see :class:`APIKeys` for
what a reload does). ``/health`` stays open for load balancers and probes.

A presented key is compared with every configured key in constant time (as
SHA-256 digests, so a key's length leaks nothing either), and no key, presented
or configured, is ever logged or echoed in an answer.

Runs in each model replica (both doors), and in each ReplicaPicker replica, which checks a key
before it reads a body.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.config import APIKeysConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.route_path import route_path

logger = logging.getLogger("ray.serve")

PROTECTED_PREFIX = "/v1/"
KEY_ID_HEX_CHARS = 16
KEY_ID_SCOPE_KEY = "api_key_id"  # where the middleware leaves the key's id: request.state.api_key_id
MIN_KEY_CHARS = 20


class APIKeysUnavailable(RuntimeError):
    """Keys are configured but their source holds none, or a malformed one: the replica refuses to start."""


class MalformedKeys(ValueError):
    """A key source's text is not one key per line; the message names the line, never the key."""


def parse_keys(text: str) -> frozenset[bytes]:
    """One key per line, as SHA-256 digests; blank lines and ``#`` comments are ignored.

    A line holding whitespace inside it (``alice sk-...``) or a key shorter than
    :data:`MIN_KEY_CHARS` is refused as a whole: such a file is a mistake, and
    guessing which part is the key would accept what nobody meant to.
    """
    digests = set()
    for number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(char.isspace() for char in key):
            raise MalformedKeys(f"line {number} holds whitespace inside a key (one key per line, nothing else)")
        if len(key) < MIN_KEY_CHARS:
            raise MalformedKeys(f"line {number} holds a key shorter than {MIN_KEY_CHARS} characters")
        digests.add(_digest(key))
    return frozenset(digests)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(eq=False)
class APIKeys:
    """The current set of accepted keys, read from an environment variable or a file.

    ``read`` returns the source's text (raising ``OSError`` when it cannot be
    read); for a file it is called again whenever the file's modification time
    changes (checked at most every ``recheck_s`` seconds). On a reload:

    * keys that parse replace the old set;
    * a malformed text, or a file that cannot be read, keeps the old set and logs an error;
    * a source with no key at all revokes every key (each request then gets 401),
      logged as an error: an operator must be able to revoke all keys at once.

    So a key file must be replaced atomically (write a new file, then rename it
    over the old one; Kubernetes swaps a mounted Secret's files that way), or a
    reader may see it half-written.
    """

    describe: str  # where the keys come from, for messages: never the keys themselves
    read: Callable[[], str]
    version: Callable[[], float] = lambda: 0.0
    recheck_s: float = 1.0
    _digests: frozenset[bytes] = field(default=frozenset(), init=False, repr=False)
    _version: float = field(default=0.0, init=False, repr=False)
    _checked_at: float = field(default=float("-inf"), init=False, repr=False)

    def __post_init__(self) -> None:
        self._version = self.version()
        try:
            self._digests = parse_keys(self.read())
        except (OSError, MalformedKeys) as exc:
            raise APIKeysUnavailable(f"API keys from {self.describe} cannot be used: {exc}") from None
        self._checked_at = time.monotonic()
        if not self._digests:
            raise APIKeysUnavailable(f"API keys are configured from {self.describe}, which holds no key")

    @classmethod
    def from_env(cls, name: str) -> APIKeys:
        return cls(f"environment variable {name}", lambda: os.environ.get(name, ""))

    @classmethod
    def from_file(cls, path: str, recheck_s: float = 1.0) -> APIKeys:
        file = Path(path)

        def version() -> float:
            try:
                return file.stat().st_mtime
            except OSError:
                return 0.0

        return cls(f"file {path}", file.read_text, version, recheck_s)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.recheck_s:
            return
        self._checked_at = now
        version = self.version()
        if version == self._version:
            return
        self._version = version
        try:
            digests = parse_keys(self.read())
        except (OSError, MalformedKeys) as exc:
            logger.error(
                "API keys from %s not reloaded, keeping the previous %d: %s", self.describe, len(self._digests), exc
            )
            return
        self._digests = digests
        if digests:
            logger.info("API keys reloaded from %s: %d keys", self.describe, len(digests))
        else:
            logger.error("API keys from %s now hold no key: every key is revoked, all requests get 401", self.describe)

    def identify(self, key: str) -> str | None:
        """The id of ``key`` if it is one of the configured keys (else None), without an early exit.

        The id (a prefix of the key's SHA-256, in hex) names the key in rate limits;
        it is not the key and cannot be turned back into it.
        """
        self._refresh()
        presented = _digest(key)
        match = False
        for digest in self._digests:
            match |= hmac.compare_digest(presented, digest)
        return presented.hex()[:KEY_ID_HEX_CHARS] if match else None


def load_api_keys(config: APIKeysConfig | None) -> APIKeys | None:
    """The keys the config names, read now; None when the config sets none."""
    if config is None:
        return None
    if config.env is not None:
        return APIKeys.from_env(config.env)
    assert config.file is not None
    return APIKeys.from_file(config.file)


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (or gRPC metadata entry), or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authenticate(keys: APIKeys, headers: Mapping[str, str]) -> str:
    """The id of the configured key ``headers`` present; 401 without a key, or with one not configured."""
    token = bearer_token(headers)
    if token is None:
        raise APIError(401, "no API key: send it in an Authorization header as 'Bearer <key>'", code="invalid_api_key")
    key_id = keys.identify(token)
    if key_id is None:
        raise APIError(401, "the API key is not valid", code="invalid_api_key")
    return key_id


class APIKeyMiddleware:
    """ASGI middleware answering 401 to ``/v1/*`` requests without an accepted key."""

    def __init__(self, app: ASGIApp, keys: APIKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            key_id = authenticate(self.keys, Headers(scope=scope))
        except APIError as error:
            await self._refuse(send, error)
            return
        # A fresh state mapping: the server's may be shared between requests.
        state = dict(scope.get("state") or {}, **{KEY_ID_SCOPE_KEY: key_id})
        await self.app(dict(scope, state=state), receive, send)

    async def _refuse(self, send: Send, error: APIError) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": error.to_json()})
