"""GLM-4's vLLM plugin: vLLM runs :func:`register` in each of its processes (front end and engine core).

pyproject.toml's ``vllm.general_plugins`` entry point names it. In grammars, a special token's
text is prefixed with GLM-4's control mark, so text a structured output writes is never a
control token: the front door refuses the mark anywhere in a request's messages, tools and
structured outputs (:mod:`serve_app.glm4.control_tokens`).

Runs in each process vLLM starts in a model replica: its front end and, with a real engine, the
engine core.
"""

from __future__ import annotations

from serve_app import vllm_internals
from serve_app.glm4.control_tokens import CONTROL_MARK


def register() -> None:
    """Make vLLM's guidance backend, and its validation of requests, keep text as text."""
    vllm_internals.guidance_reads_text_as_text(CONTROL_MARK)
