"""Driving a simulated engine from outside: hold it, pace it, make it die or hang, read it.

The simulated engine stands in for the GPU in the tests of the serving layer under load
and faults. Those tests set up what they measure instead of racing it: requests held in
the engine while a burst arrives, a death or a hang at a chosen moment, the engine's own
count of what it holds. They reach a model replica through the cluster's switchboard
(:mod:`serve_app.simulated_engine.switchboard`: a Ray actor, which needs the cluster's token;
never HTTP), followed only by replicas whose model's config has a ``simulated_engine``
section, which no production config has (a test checks every config the Kubernetes
manifests carry).

Runs in each model replica with a simulated engine, and in the tests and benchmarks that post
controls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# While paused, an empty engine output this often: the replica's watch sees an engine that
# is alive but busy elsewhere, not a hung one (a hang is its own control).
HEARTBEAT_S = 0.5


class Control(enum.Enum):
    PAUSE = "pause"  # requests are admitted and held: no step runs, no token comes
    RESUME = "resume"  # steps run again from now (also ends a hang)
    PACE = "pace"  # every step takes `pace` times what the timing model says
    FAIL = "fail"  # the engine dies now, through vLLM's own engine-dead error path
    HANG = "hang"  # no step and no sign of life while requests are held: the watchdog's case
    STATE = "state"  # change nothing; read it


@dataclass(frozen=True)
class EngineState:
    """What a simulated engine is doing and holding."""

    paused: bool
    hung: bool
    dead: bool
    pace: float
    running: int  # sequences in the batch
    waiting: int  # sequences admitted but not yet scheduled
    steps: int  # engine steps completed since start
    tokens: int  # tokens generated since start
    busy_s: float  # simulated GPU time of those steps (each the timing model's time x pace)

    @property
    def holds(self) -> int:
        """Sequences the engine holds (each choice of a request is one)."""
        return self.running + self.waiting


@dataclass
class Switches:
    """The controls' current settings, read by the engine core before each step."""

    paused: bool = False
    hung: bool = False
    pace: float = 1.0

    def apply(self, control: Control, pace: float | None = None) -> None:
        """Set what ``control`` sets (``FAIL`` is the core's own: it ends the engine)."""
        if control is Control.PAUSE:
            self.paused = True
        elif control is Control.RESUME:
            self.paused = self.hung = False
        elif control is Control.HANG:
            self.hung = True
        elif control is Control.PACE:
            if pace is None or not pace > 0:
                raise ValueError("pace must be a positive factor (2.0: every step takes twice as long)")
            self.pace = pace
