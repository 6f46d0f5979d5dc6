"""Telemetry every process uses: traces, gauges that last while idle, vLLM's engine metrics.

The front door's per-request record, metrics and log live in :mod:`serve_app.front_door`; the
router's metrics in :mod:`serve_app.routing`.

Runs in each model replica and each ReplicaPicker replica.
"""
