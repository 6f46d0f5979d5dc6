"""Structured outputs: which grammar engine vLLM decodes JSON schemas with, and why.

Under ``response_format`` (``json_schema`` or ``json_object``) and under a forced tool
call's schema (``tool_choice`` ``"required"`` or a named function), vLLM masks every
token the schema does not allow, through one of its grammar backends. A client
library (LangChain's ``with_structured_output``, instructor) then parses the answer
and has no way to recover when it is not valid JSON.

This app runs llguidance (vLLM's ``guidance`` backend) and refuses the others:

* xgrammar 0.2.8, vLLM 0.32's default, lets raw control characters (U+0001 to U+001F
  but for newline and carriage return) into a JSON string whose schema sets
  ``minLength`` or ``maxLength``, which RFC 8259 forbids (mlc-ai/xgrammar#286 was fixed
  for plain strings only), and admits bytes that are not UTF-8, so such a string can
  decode longer than its ``maxLength``: 16 of 30 answers for a pydantic model with one
  ``Field(max_length=12)`` failed to parse. ``tests/unit/config/test_structured_outputs.py``
  fails once an installed xgrammar keeps such strings valid; then the choice can be
  revisited.
* llguidance refuses every JSON Schema keyword it cannot enforce (``uniqueItems``,
  ``not``, ``if``/``then``, ``contains``, ``propertyNames``, ``dependentRequired``, a
  ``oneOf`` whose branches can overlap, an unknown ``format``), so vLLM answers such a
  request with a 400 naming the keyword instead of an answer that breaks the schema;
  vLLM's xgrammar path takes ``not`` and an overlapping ``oneOf`` without enforcing them.
* ``auto`` picks xgrammar whenever xgrammar accepts the schema.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from __future__ import annotations

from typing import Any

GRAMMAR_BACKEND = "guidance"


def with_grammar_backend(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``engine_args`` with ``structured_outputs_config.backend`` set to :data:`GRAMMAR_BACKEND`.

    Left out, it is set; any other backend is refused with the reason. Left out too,
    ``disable_additional_properties`` is on: an object schema that does not say
    ``additionalProperties`` gets only the keys it names (as under xgrammar), so a
    model cannot spend its tokens on keys nobody asked for.
    """
    config = dict(engine_args.get("structured_outputs_config") or {})
    config.setdefault("disable_additional_properties", True)
    backend = config.setdefault("backend", GRAMMAR_BACKEND)
    if backend != GRAMMAR_BACKEND:
        raise ValueError(
            f"structured_outputs_config.backend {backend!r} refused: only {GRAMMAR_BACKEND!r} (llguidance) "
            "keeps every answer under a JSON schema valid JSON that satisfies it (xgrammar 0.2.8 lets raw "
            "control characters into length-bounded strings; see docs/api-behaviour.md)"
        )
    return engine_args | {"structured_outputs_config": config}
