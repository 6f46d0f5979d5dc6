"""A request's structured-output grammar is built first at the front door, where its time can be bounded.

vLLM builds a grammar where nothing can stop it: llguidance validates it on the
model replica's event loop, then the engine compiles it again. A spec's size does
not bound that work: ``{"type": "array", "minItems": 1000000000}`` is 41 characters,
and llguidance builds its items one by one (100 ms and 100 MB per million on this
project's 2-core VM), so one such request would stall every stream on a replica
for minutes and then run it out of memory. So the front door builds every request's
grammar first, the way vLLM will (:func:`serve_app.vllm_internals.build_request_grammar`),
in its checker process (:class:`serve_app.front_door.admission.large_bodies.BodyChecker`), which
is killed when the build passes ``ingress.max_grammar_build_s``; the request gets a
400 ``grammar_too_costly`` and never reaches a replica.

The build includes the engine's matcher, so the limit bounds the engine's compile too, and a
grammar the engine could not build (llguidance answers 70,000 optional array items with a
failed assertion, after which vLLM's engine lets the answer only end: an empty 200) is a 400
``invalid_grammar`` naming llguidance's error.

Runs in each model replica; the build itself in its checker process (:mod:`.large_bodies`).
"""

from __future__ import annotations

import pickle

from serve_app.protocol import PickledRequest


def pickled(payload: object) -> bytes:
    """The validated request as the checker process is sent it."""
    if isinstance(payload, PickledRequest):
        return payload.data
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def build_grammar(request: bytes) -> str | None:
    """In the checker process: build the grammar of a pickled, validated request; the error its
    engine would meet, if any (:func:`serve_app.vllm_internals.build_request_grammar`)."""
    from serve_app.vllm_internals import build_request_grammar

    return build_request_grammar(pickle.loads(request))


def warm_up() -> None:
    """In a new checker process: import and run what a build needs, so that no request's time limit
    counts vLLM's imports."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from serve_app.vllm_internals import build_request_grammar

    build_request_grammar(CompletionRequest(model="m", prompt="p", structured_outputs={"json": {"type": "object"}}))
