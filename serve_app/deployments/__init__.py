"""The Serve deployments: each class Serve runs, and the one place its own pieces are put together.

- :mod:`.model_server`: ``ModelServer``, the model deployment and the application's
  ingress. Runs in each model replica: the front door (:mod:`serve_app.front_door`) over the
  engine (:mod:`serve_app.engine`), called in-process.
- :mod:`.replica_picker`: ``ReplicaPicker``, which Serve's HAProxy asks which model replica
  takes a request. Runs in its own replicas, with the model's request router
  (:mod:`serve_app.routing`).
- :mod:`.rate_limiter`: ``RateLimiter``, every API key's counts. Runs in its own replica.

:func:`serve_app.app.build_app` binds them into the application.
"""
