"""What quantisation gives one replica, by the simulated engine's timing model: estimates, not runs.

For each variant (vLLM's ``quantization`` and ``kv_cache_dtype``) on a GPU, the
weights, the KV cache's tokens and concurrent 8K-token conversations, one decode step,
and decode tokens/s at 64 and 256 streams, from :mod:`serve_app.glm4.sizing` and
:class:`serve_app.simulated_engine.timing.GpuTiming` (weights and KV read once per step
at the GPU's memory bandwidth). A GPU run's figures replace them.

    python -m benchmarks.quantised_sizing [--context 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from serve_app.config import SimulatedEngineConfig, sized_for
from serve_app.glm4 import sizing
from serve_app.simulated_engine.timing import GpuTiming

CONVERSATION_TOKENS = 8192


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float
    bandwidth_tb_s: float  # the vendor's published memory bandwidth


H100 = Gpu("H100 SXM 80 GB", 80, 3.35)
L4 = Gpu("L4 24 GB", 24, 0.3)
A10G = Gpu("A10G 24 GB", 24, 0.6)

# The 4-bit checkpoint of deploy/config.w4a16.yaml (serve_app/ops/quantise_w4a16.py): vLLM's argument is
# compressed-tensors, whose bits only the checkpoint says; 4 bits and a bf16 scale per group of
# 128, as GPTQ's.
W4A16_GB = sizing.weights_gb("gptq")

# (GPU, vLLM's engine arguments, weights in GB where the arguments do not size them): bf16 as
# shipped, FP8 weights and KV cache on the H100 (compute capability 9.0; deploy/config.fp8.yaml),
# 4-bit weights with an FP8 KV cache on a 24 GB A10G (deploy/config.w4a16.yaml), and on a 24 GB L4
# (8.9) a 4-bit AWQ checkpoint or FP8.
VARIANTS: list[tuple[Gpu, dict[str, Any], float | None]] = [
    (H100, {}, None),
    (H100, {"kv_cache_dtype": "fp8"}, None),
    (H100, {"quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8"}, None),
    (A10G, {}, None),
    (A10G, {"quantization": "compressed-tensors", "kv_cache_dtype": "fp8"}, W4A16_GB),
    (L4, {}, None),
    (L4, {"quantization": "awq_marlin", "kv_cache_dtype": "fp8"}, None),
    (L4, {"quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8"}, None),
]


def estimate(gpu: Gpu, engine_args: dict[str, Any], context: int, weights_gb: float | None = None) -> dict[str, Any]:
    hardware = {"gpu_memory_gb": gpu.memory_gb, "memory_bandwidth_tb_s": gpu.bandwidth_tb_s, "weights_gb": weights_gb}
    settings = SimulatedEngineConfig.model_validate(sized_for(hardware, engine_args))
    timing = GpuTiming.from_config(settings)
    return {
        "gpu": gpu.name,
        "quantization": engine_args.get("quantization") or "none (bf16)",
        "kv_cache_dtype": engine_args.get("kv_cache_dtype", "auto (bf16)"),
        "weights_gb": round(settings.resolved_weights_gb(), 1),
        "kv_cache_tokens": timing.kv_capacity_tokens,
        "conversations_8k": timing.kv_capacity_tokens // CONVERSATION_TOKENS,
        "decode_step_ms_1_stream": round(timing.step_s(context, 0) * 1e3, 2),
        "tokens_per_s_64": round(timing.decode_tokens_per_s(64, context)),
        "tokens_per_s_256": round(timing.decode_tokens_per_s(256, context))
        if 256 * context <= timing.kv_capacity_tokens
        else None,  # (the cache cannot hold 256 streams at this context)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048, help="mean context tokens of each decoding stream")
    parser.add_argument("--json", action="store_true", help="one JSON object per variant")
    args = parser.parse_args(argv)
    rows = [estimate(gpu, engine_args, args.context, weights) for gpu, engine_args, weights in VARIANTS]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print(
            "| "
            + " | ".join("-" if v is None else f"{v:,}" if isinstance(v, int) else str(v) for v in row.values())
            + " |"
        )


if __name__ == "__main__":
    main()
