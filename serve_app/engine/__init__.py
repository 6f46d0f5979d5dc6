"""The engine: vLLM's ``AsyncLLM`` and OpenAI serving code, with GLM-4's changes. Runs in each model replica.

- :mod:`.build`: the engine and vLLM's serving objects (finished for GLM-4 by
  :mod:`serve_app.glm4.serving`) built from a model's config; the benchmarks build theirs with it.
- :mod:`.server`: ``EngineServer``, the engine half of the model deployment: answers ``chat``
  and ``completion`` with the generator protocol of :mod:`serve_app.protocol`; health and load.
- :mod:`.engine_watch`: stops the engine of a replica whose engine died or hung.
- :mod:`.context_limit`: refuses a prompt plus ``max_tokens`` that does not fit the context.
- :mod:`.stream_transforms`: shapes vLLM's SSE stream before it leaves the engine.

It knows nothing of the front door: :mod:`serve_app.deployments.model_server` puts the two together.
"""
