"""A simulated GLM-4-9B-Chat engine: vLLM's serving path at GPU speed, with no GPU.

A model replica whose config sets ``simulated_engine`` runs vLLM's ``AsyncLLM``
as it always does, but with :class:`~serve_app.simulated_engine.core.SimulatedEngineCore`
where vLLM would start its engine-core process (the scheduler, the model on the
GPU). Everything above that line is the real code: tokenizer, chat template, vLLM's
OpenAI serving objects and SSE framing, detokenizer, stop strings, ``n``, aborts,
vLLM's metrics, and all of this app. Only token generation is replaced.

- :mod:`~serve_app.simulated_engine.timing`: how long an engine step takes on an
  H100, from the physical figures (weights and KV cache read per decode step,
  prefill compute per token), and the KV cache's capacity in tokens.
- :mod:`~serve_app.simulated_engine.batch`: continuous batching as vLLM's scheduler
  does it, pure logic: running sequences, chunked prefill within a token budget,
  waiting requests in order, preemption when the KV cache is full, stop rules.
- :mod:`~serve_app.simulated_engine.prefix_cache`: vLLM's automatic prefix caching:
  cached prompt blocks by chained hash, least recently used out first, hit counts.
- :mod:`~serve_app.simulated_engine.core`: the engine-core client ``AsyncLLM``
  talks to: one timer per step, vLLM's output types.

Runs in each model replica whose config sets ``simulated_engine``, in place of vLLM's engine-core
process.
"""

# Every response's system_fingerprint: a simulated answer is never taken for the model's.
FINGERPRINT = "simulated-glm-4-9b-chat-h100"
