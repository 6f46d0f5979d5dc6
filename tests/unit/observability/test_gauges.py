"""RefreshedGauges: the last value of each gauge and tag set is set in Ray from its thread, again
and again until the process ends; the caller only records it."""

from __future__ import annotations

import threading

from serve_app.observability.gauges import RefreshedGauges


class RecordingGauge:
    """Records every set (Ray's gauge needs a Ray worker; this is the same call)."""

    def __init__(self) -> None:
        self.sets: list[tuple[float, dict[str, str]]] = []
        self.changed = threading.Condition()

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        with self.changed:
            self.sets.append((value, dict(tags or {})))
            self.changed.notify_all()


def test_refresh_sets_the_last_value_of_each_tag_set_again():
    gauge, kept = RecordingGauge(), RefreshedGauges(refresh_s=3600)
    kept.set(gauge, 3, {"model": "a"})
    kept.set(gauge, 0, {"model": "a"})
    kept.set(gauge, 5, {"model": "b"})
    gauge.sets.clear()
    kept.refresh()
    assert sorted(gauge.sets, key=lambda s: s[1]["model"]) == [(0, {"model": "a"}), (5, {"model": "b"})]
    kept.stop()


def test_a_background_thread_keeps_setting_the_value_while_nothing_changes():
    gauge, kept = RecordingGauge(), RefreshedGauges(refresh_s=0.01)
    kept.set(gauge, 7, {"model": "a"})
    with gauge.changed:
        assert gauge.changed.wait_for(lambda: len(gauge.sets) >= 3, timeout=10)
    kept.stop()
    assert {value for value, _ in gauge.sets} == {7}


def test_a_set_only_records_the_value_and_the_thread_sets_it_in_ray():
    """A change of phase on the event loop costs a dict write: Ray's gauge is set by the refresh."""
    gauge, kept = RecordingGauge(), RefreshedGauges(refresh_s=3600)
    for value in range(100):
        kept.set(gauge, value, {"model": "a"})
    assert gauge.sets == []
    kept.refresh()
    assert gauge.sets == [(99, {"model": "a"})]
    kept.stop()
