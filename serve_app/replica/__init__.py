"""Runs in the model deployment's replicas: a vLLM engine and vLLM's OpenAI serving code.

``deployment`` is the Serve deployment (``ModelServer``); ``engine_watch`` ends a
replica whose engine died or hung; ``context_limit`` checks prompt plus
``max_tokens``; ``stream_transforms`` shapes vLLM's SSE stream before it leaves.
"""
