"""API keys: when configured, every ``/v1/*`` request needs ``Authorization: Bearer <key>``.

Keys come from an environment variable or a file, either of which a Kubernetes
Secret fills. A file is re-read when it changes, so rotating the Secret takes
effect without restarting anything (Kubernetes swaps a mounted Secret's files
atomically). ``/health`` stays open for load balancers and probes.

A presented key is compared with every configured key in constant time (as
SHA-256 digests, so a key's length leaks nothing either), and no key, presented
or configured, is ever logged or echoed in an answer.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.config import APIKeysConfig
from serve_app.errors import APIError

logger = logging.getLogger("ray.serve")

PROTECTED_PREFIX = "/v1/"
KEY_ID_HEX_CHARS = 16
KEY_ID_SCOPE_KEY = "api_key_id"  # where the middleware leaves the key's id: request.state.api_key_id
_SEPARATORS = re.compile(r"[\s,]+")


class APIKeysUnavailable(RuntimeError):
    """Keys are configured but their source holds none: the ingress refuses to start (fail closed)."""


def parse_keys(text: str) -> frozenset[bytes]:
    """Keys separated by commas, spaces or newlines, as SHA-256 digests; blank entries ignored."""
    return frozenset(_digest(k) for k in _SEPARATORS.split(text) if k)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(eq=False)
class APIKeys:
    """The current set of accepted keys, read from an environment variable or a file.

    ``read`` returns the source's text; for a file it is called again whenever
    the file's modification time changes (checked at most every
    ``recheck_s`` seconds). A source that becomes empty keeps the previous keys:
    a half-written file must not lock every client out, nor let any in.
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
        self._digests = parse_keys(self.read())
        self._checked_at = time.monotonic()
        if not self._digests:
            raise APIKeysUnavailable(f"API keys are configured from {self.describe}, which holds no key")

    @classmethod
    def from_env(cls, name: str) -> APIKeys:
        return cls(f"environment variable {name}", lambda: os.environ.get(name, ""))

    @classmethod
    def from_file(cls, path: str, recheck_s: float = 1.0) -> APIKeys:
        file = Path(path)

        def read() -> str:
            try:
                return file.read_text()
            except OSError:
                return ""

        def version() -> float:
            try:
                return file.stat().st_mtime
            except OSError:
                return 0.0

        return cls(f"file {path}", read, version, recheck_s)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.recheck_s:
            return
        self._checked_at = now
        version = self.version()
        if version == self._version:
            return
        self._version = version
        digests = parse_keys(self.read())
        if digests:
            self._digests = digests
            logger.info("API keys reloaded from %s: %d keys", self.describe, len(digests))
        else:
            logger.warning("API keys from %s are now empty; keeping the previous keys", self.describe)

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

    def accepts(self, key: str) -> bool:
        return self.identify(key) is not None


def load_api_keys(config: APIKeysConfig | None) -> APIKeys | None:
    """The keys the config names, read now; None when the config sets none."""
    if config is None:
        return None
    if config.env is not None:
        return APIKeys.from_env(config.env)
    assert config.file is not None
    return APIKeys.from_file(config.file)


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def route_path(scope: Scope) -> str:
    """The path below the application's route prefix (Serve's ``route_prefix`` is the ASGI root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class APIKeyMiddleware:
    """ASGI middleware answering 401 to ``/v1/*`` requests without an accepted key."""

    def __init__(self, app: ASGIApp, keys: APIKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope))
        key_id = None if token is None else self.keys.identify(token)
        if token is None:
            error = APIError(
                401,
                "no API key: send it in an Authorization header as 'Bearer <key>'",
                code="invalid_api_key",
            )
        elif key_id is None:
            error = APIError(401, "the API key is not valid", code="invalid_api_key")
        else:
            # A fresh state mapping: the server's may be shared between requests.
            state = dict(scope.get("state") or {}, **{KEY_ID_SCOPE_KEY: key_id})
            await self.app(dict(scope, state=state), receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": error.to_json()})
