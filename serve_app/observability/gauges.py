"""Gauges that keep reporting their value while it stays the same.

Ray's metrics agent drops a gauge's series once its process has not set it for
two export intervals (20 s with Ray's default ``metrics_report_interval_ms`` of 10 s):
an idle replica's "0 requests running" vanished from the scrape, so a dashboard
showed "No data" and an alert could not tell 0 from a missing replica.

:class:`RefreshedGauges` remembers the last value set for each gauge and tag set and
sets them all in Ray every fifth of the export interval (:func:`refresh_interval_s`) from a
daemon thread, for as long as the process lives; ``set`` only remembers. Ray exports what
was set last at each interval, so a value is exported at most a fifth of an interval later,
and a change of phase costs the event loop a dict write, not Ray's record (a request moves
phase 3-4 times: its Ray sets were a tenth of a CPU replica's loop while 600 requests
arrived, docs/performance-history.md). A replica that is gone stops reporting, and its series age
out as before.

Runs in each model replica and each ReplicaPicker replica, a daemon thread in each.
"""

from __future__ import annotations

import threading
from typing import Protocol

from serve_app.serve_internals import metrics_export_interval_s


def refresh_interval_s() -> float:
    """How often kept gauges are set again: a fifth of Ray's export interval (2 s by default),
    well inside the two intervals after which the agent drops an unset gauge."""
    return metrics_export_interval_s() / 5


class Gauge(Protocol):
    """Ray's ``ray.util.metrics.Gauge`` (and Serve's, which adds the replica's tags)."""

    def set(self, value: float, tags: dict[str, str] | None = None) -> None: ...


class RefreshedGauges:
    """Keeps the last value of each gauge and sets it in Ray, again and again, from its thread."""

    def __init__(self, refresh_s: float | None = None) -> None:
        self.refresh_s = refresh_s  # None: read from Ray's config when the refreshing starts
        self._last: dict[tuple[int, frozenset[tuple[str, str]]], tuple[Gauge, float, dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def set(self, gauge: Gauge, value: float, tags: dict[str, str]) -> None:
        with self._lock:
            self._last[id(gauge), frozenset(tags.items())] = (gauge, value, tags)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="refreshed-gauges", daemon=True)
                self._thread.start()

    def refresh(self) -> None:
        with self._lock:
            last = list(self._last.values())
        for gauge, value, tags in last:  # (outside the lock: a set never waits for Ray's records)
            gauge.set(value, tags=tags)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        refresh_s = self.refresh_s if self.refresh_s is not None else refresh_interval_s()
        while not self._stop.wait(refresh_s):
            self.refresh()


_process_gauges = RefreshedGauges()


def refreshed_gauges() -> RefreshedGauges:
    """This process's keeper: the front door's gauges and the engine's share one thread."""
    return _process_gauges
