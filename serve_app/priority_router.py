"""PriorityOrderedRouter: Serve's power of two choices, routing waiting requests lowest priority first.

The model deployment's request router on the relay path with fair share when prefix
routing is off (with it on, :class:`serve_app.prefix_routing.router.PrefixAffinityRouter`
orders the same way). How requests are ordered is :class:`serve_app.serve_internals.PriorityOrder`.
"""

from __future__ import annotations

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from serve_app.serve_internals import PriorityOrder


class PriorityOrderedRouter(PriorityOrder, PowerOfTwoChoicesRequestRouter):
    """Power of two choices for the replica; the lowest ``priority`` among waiting requests goes first."""


ROUTER_CLASS_PATH = f"{__name__}:{PriorityOrderedRouter.__name__}"
