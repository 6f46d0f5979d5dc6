"""What a failed end-to-end run prints of its engines (tests/e2e/harness/ray_cluster.py,
``RayCluster.engine_failures``) finds the lines the replicas' engine watch writes when an engine
dies or hangs, and vLLM's engine processes' errors without their tracebacks' frames, and nothing
else: a reworded watch message fails here, not as a CI failure that prints "none"."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from serve_app.engine.engine_watch import EngineProgress, EngineWatch
from tests.e2e.harness.ray_cluster import RayCluster


def watch_says(caplog: pytest.LogCaptureFixture, *, hung: bool) -> list[str]:
    """The lines the watch logs when its engine hangs (``hung``) or dies, read from the watch itself."""
    clock = [0.0]
    progress = EngineProgress(clock=lambda: clock[0])
    watch = EngineWatch(
        engine_dead=lambda: not hung,
        leave=lambda: None,
        held=lambda: 1,
        stall_timeout_s=1.0 if hung else None,
        progress=progress,
    )
    clock[0] = 5.0  # holding a request with no output for 5 s
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        caplog.clear()
        asyncio.run(watch.watch(poll_s=0.01, drain_s=0.0, deliver_s=0.0))
    return [record.getMessage() for record in caplog.records]


def test_the_watchs_lines_and_vllms_engine_errors_are_found_and_nothing_else(caplog, tmp_path: Path) -> None:
    hung, died = watch_says(caplog, hung=True), watch_says(caplog, hung=False)
    assert hung and died
    serve_logs = tmp_path / "session_1" / "logs" / "serve"
    serve_logs.mkdir(parents=True)
    ordinary = [
        "INFO 2026-12-06 20:44:41,933 glm_model-glm-4-9b-chat zk218ctk -- Started initializing replica.",
        "INFO model glm-4-9b-chat ready (max_model_len=1024, eos/stop token ids=[151329])",
    ]
    replica_lines = [ordinary[0], *(f"ERROR 2026-12-06 glm zk218ctk -- {line}" for line in hung + died), ordinary[1]]
    (serve_logs / "replica_glm_model-glm-4-9b-chat_zk218ctk.log").write_text("\n".join(replica_lines) + "\n")
    engine = "(EngineCore pid=6915) ERROR 12-06 20:45:42 [core.py:1020]"
    engine_errors = [f"{engine} EngineCore encountered a fatal error.", f"{engine} ValueError: a grammar failed"]
    frames = [
        f"{engine} Traceback (most recent call last):",
        f'{engine}   File "vllm/v1/engine/core.py", line 676, in step',
        f"{engine}     model_output = self.model_executor.sample_tokens(grammar_output)",
        f"{engine}                    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    ]
    engine_info = "(EngineCore pid=6915) INFO 12-06 20:46:35 [core.py:402] init engine took 30.74 s"
    engine_log = [engine_info, engine_errors[0], *frames, engine_errors[1]]
    (serve_logs.parent / "worker-65bb-01000000-5222.err").write_text("\n".join(engine_log) + "\n")
    cluster = RayCluster(root=tmp_path, gcs_port=0, dashboard_port=0, metrics_port=0, agent_port=0, serve_ports={})

    found = cluster.engine_failures()

    assert len(found) == len(hung) + len(died) + len(engine_errors)
    assert all(any(line in entry for entry in found) for line in [*hung, *died, *engine_errors])
    assert not any(line in entry for entry in found for line in [*ordinary, engine_info, *frames])
