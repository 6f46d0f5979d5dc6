"""What the simulated engine itself costs in CPU, with no HTTP and no Ray.

Two figures per batch size, each CPU seconds (this process's, from the OS) per
1,000 generated tokens:

- ``core``: the simulated engine core alone (continuous batching, token draws,
  vLLM's output structures), driven as ``AsyncLLM`` drives it: requests added,
  step outputs read until every request ended. This is what the simulation adds
  to a model replica's process.
- ``async_llm``: the same through vLLM's ``AsyncLLM`` (input processing,
  detokenizer, per-request output queues), which a replica runs with the real
  engine too: the floor of any serving layer on top of vLLM.

    python -m benchmarks.simulated_engine_cost --config deploy/config.sim.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import yaml

from serve_app.config import ModelConfig
from serve_app.engine.build import build_engine, engine_config


def model_config(path: Path) -> ModelConfig:
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    model = ModelConfig.model_validate(args["models"][0])
    if model.simulated_engine is None:
        raise SystemExit(f"{path}: the first model has no simulated_engine section")
    return model


async def core_alone(model: ModelConfig, sequences: int, prompt: int, tokens: int) -> dict[str, float]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    from serve_app.simulated_engine.core import SimulatedEngineCore

    assert model.simulated_engine is not None
    tokenizer = AutoTokenizer.from_pretrained(model.engine_args["model"])
    core = SimulatedEngineCore(engine_config(model).vllm_config, tokenizer, model.simulated_engine)
    started_cpu, started = time.process_time(), time.perf_counter()
    for i in range(sequences):
        params = SamplingParams(max_tokens=tokens)
        request = EngineCoreRequest(
            f"r{i}", list(range(20, 20 + prompt)), None, params, None, time.time(), None, None, None
        )
        await core.add_request_async(request)
    generated = finished = 0
    while finished < sequences:
        outputs = await core.get_output_async()
        generated += sum(len(o.new_token_ids) for o in outputs.outputs)
        finished += sum(1 for o in outputs.outputs if o.finished)
    return _figures(generated, time.process_time() - started_cpu, time.perf_counter() - started)


async def through_async_llm(model: ModelConfig, sequences: int, prompt: int, tokens: int) -> dict[str, float]:
    from vllm import SamplingParams

    assert model.simulated_engine is not None
    engine = build_engine(engine_config(model))  # as a model replica builds it

    async def one(i: int) -> int:
        final = None
        params = SamplingParams(max_tokens=tokens)
        async for output in engine.generate({"prompt_token_ids": list(range(20, 20 + prompt))}, params, f"r{i}"):
            final = output
        assert final is not None
        return len(final.outputs[0].token_ids)

    try:
        started_cpu, started = time.process_time(), time.perf_counter()
        generated = sum(await asyncio.gather(*(one(i) for i in range(sequences))))
        return _figures(generated, time.process_time() - started_cpu, time.perf_counter() - started)
    finally:
        engine.shutdown()


def _figures(tokens: int, cpu_s: float, wall_s: float) -> dict[str, float]:
    return {
        "tokens": tokens,
        "cpu_s_per_1k_tokens": round(1000 * cpu_s / tokens, 5),
        "tokens_per_s": round(tokens / wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("deploy/config.sim.yaml"))
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    model = model_config(args.config)
    results: dict[str, Any] = {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "rows": []}
    print(f"{'sequences':>10} {'part':>10} {'tokens':>8} {'cpu s/1k tok':>13} {'tok/s':>9}")
    for sequences in args.sequences:
        for part, run in (("core", core_alone), ("async_llm", through_async_llm)):
            figures = asyncio.run(run(model, sequences, args.input_tokens, args.output_tokens))
            results["rows"].append({"sequences": sequences, "part": part} | figures)
            print(
                f"{sequences:>10} {part:>10} {figures['tokens']:>8} "
                f"{figures['cpu_s_per_1k_tokens']:>13.4f} {figures['tokens_per_s']:>9.0f}"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
