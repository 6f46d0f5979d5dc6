"""Runs in the model deployment's replicas: a vLLM engine and vLLM's OpenAI serving code.

``deployment`` is the engine side of the model deployment (``ModelServer``), which
``front_door`` (``DirectModelServer``, the class Serve runs) puts behind the front door; ``engine_watch`` ends a
replica whose engine died or hung; ``context_limit`` checks prompt plus
``max_tokens``; ``stream_transforms`` shapes vLLM's SSE stream before it leaves.
"""
