"""The front door, run inside each model replica (serve_app.replica.front_door): HTTP, validation, admission.

``routes`` is its Starlette app; ``replica_client`` the call to the engine (in this
process) and its stream. The rest are the policies the routes apply (keys, limits,
deadlines, body checks) and the model router. ``rate_limits`` also holds the small
``RateLimiter`` deployment every model replica asks.
"""
