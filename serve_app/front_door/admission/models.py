"""ModelCatalog: the model a request names, what answers it, and the model list.

Pure logic over the models the deployment passed in (in production, one: this replica's
engine), so it is tested without Ray. Per-request policies (API keys, rate limits, timeouts)
have their seam in :mod:`serve_app.front_door.admission.pipeline`, not here.

Runs in each model replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from serve_app.errors import APIError, quoted

H = TypeVar("H")


@dataclass(frozen=True)
class ModelEntry(Generic[H]):
    name: str
    model: H  # what answers its requests (serve_app.front_door.core.generation.Model)
    max_model_len: int | None = None
    max_output_tokens: int | None = None  # the model's ceiling on one answer's tokens (None: the context)
    simulated: bool = False  # served by the simulated engine: its answers are not the model's


@dataclass
class ModelCatalog(Generic[H]):
    """Maps the ``model`` field of a request to what serves it."""

    entries: dict[str, ModelEntry[H]]
    created: int = field(default_factory=lambda: int(time.time()))

    def entry_for(self, model: Any) -> ModelEntry[H]:
        """The entry for ``model``; 400 when it is missing, 404 when nobody serves it."""
        if model is None or model == "":
            raise APIError(400, "you must provide a model parameter", param="model")
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model")
        entry = self.entries.get(model)
        if entry is None:
            served = ", ".join(sorted(self.entries))
            raise APIError(
                404,
                f"The model '{quoted(model)}' does not exist. Served models: {served}",
                param="model",
                code="model_not_found",
            )
        return entry

    def model_list(self) -> dict[str, Any]:
        """The body of ``GET /v1/models``, in the OpenAI shape."""
        return {
            "object": "list",
            "data": [
                {
                    "id": entry.name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "simulated" if entry.simulated else "serve_app",
                    "max_model_len": entry.max_model_len,
                    "simulated": entry.simulated,
                }
                for entry in self.entries.values()
            ],
        }
