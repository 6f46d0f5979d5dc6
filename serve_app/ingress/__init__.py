"""Runs in the ingress deployment's replicas: HTTP, validation, routing, calling model replicas.

``deployment`` is the Serve deployment; ``routes`` its Starlette app;
``replica_client`` the calls to model replicas. The rest are the policies the
routes apply (keys, limits, deadlines, body checks) and the model router.
``rate_limits`` also holds the small ``RateLimiter`` deployment the ingress asks.
"""
