"""The one way the front door reads a request's route.

Serve passes an application's ``route_prefix`` as the ASGI ``root_path``, and
``path`` still holds it: under ``route_prefix: /glm`` a chat request's path is
``/glm/v1/chat/completions``. Everything that matches routes by hand (API keys,
the request record behind metrics, logs and spans) reads :func:`route_path`,
so none of it silently stops matching under a prefix.

Runs in each model replica, and in each ReplicaPicker replica through :mod:`.auth`.
"""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """The path below the application's route prefix."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
