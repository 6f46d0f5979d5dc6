"""vLLM's own OpenAI API server on the simulated engine: the other side of ``benchmarks.serving_overhead``.

    python -m benchmarks.vllm_frontend --simulated-engine '{"load_s": 0}' -- --model models/tiny-glm4 --port 8100

Everything after ``--`` goes to vLLM's API server (``vllm.entrypoints.openai.api_server``)
unchanged, which builds its FastAPI app, ``init_app_state`` and uvicorn server as it always
does, in one process; only its ``AsyncLLM`` talks to the simulated engine core instead of
starting the engine-core process, exactly as a model replica of this app does.
"""

from __future__ import annotations

import argparse
import sys

from serve_app import vllm_internals
from serve_app.config import SimulatedEngineConfig
from serve_app.simulated_engine.core import simulated_core_factory


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_frontend", description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulated-engine", default="{}", help="the simulated_engine settings, as JSON")
    args = parser.parse_args(argv[:split])
    settings = SimulatedEngineConfig.model_validate_json(args.simulated_engine)

    from vllm.entrypoints.launchers.api_server.entry import main as vllm_api_server

    sys.argv = ["vllm.entrypoints.openai.api_server", *argv[split + 1 :]]
    with vllm_internals.engine_core_replaced(simulated_core_factory(settings)):
        vllm_api_server()


if __name__ == "__main__":
    main()
