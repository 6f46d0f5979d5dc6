"""What every section of the serve config's ``args`` shares: strict, frozen models.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class StrictModel(BaseModel):
    """A section of the config: unknown keys are refused, and a parsed config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
