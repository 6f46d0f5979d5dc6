"""The front door: what a client's request passes before the engine. Runs in each model replica.

Two doors over one admission pipeline: :mod:`.http_app` (Starlette: the OpenAI-compatible
HTTP API) and :mod:`.grpc_api` (``glm4serve.v1.Generation``). Both hand each request to
:mod:`.admission` (API key, body checks, strict validation, cost bounds, rate limits, a
generation slot), then to :mod:`.engine_call`, which calls the model (:mod:`.local_engine`:
this replica's engine, in-process) under the request's deadlines and streams its answer.
The policies each live in a module of their own (:mod:`.auth`, :mod:`.validation`,
:mod:`.request_cost`, :mod:`.large_bodies`, :mod:`.rate_limits`, :mod:`.capacity`,
:mod:`.deadlines`), read from the serve config's ``ingress`` section by :mod:`.settings`;
:mod:`.record`, :mod:`.metrics` and :mod:`.request_log` observe each request.
"""
