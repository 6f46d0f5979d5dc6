"""GLM-4-9B-Chat's bytes: its weights under each quantisation, its KV cache per token under each cache dtype.

From the model's shape (both checkpoints): 40 layers of hidden size 4,096, an MLP of
13,696, grouped-query attention with 2 KV heads of 128 dimensions, and a vocabulary of
151,552 whose input embedding and output head are separate matrices. The layers' linear
weights are 8.16 B parameters, the two vocabulary matrices 1.24 B: 9.40 B in all. Weight
quantisation (vLLM's ``quantization``) shrinks the linear weights; vLLM keeps the
vocabulary matrices in the activations' dtype (bf16). The KV cache (vLLM's
``kv_cache_dtype``) holds, per token, a key and a value of 2 x 128 per layer.

Estimates from the shape, not measurements: a GPU run's memory profile replaces them.

Runs in the application's build (the config's checks) and in each model replica with a simulated
engine (its timing).
"""

from __future__ import annotations

LAYERS, HIDDEN, MLP, KV_HEADS, HEAD_DIM, VOCABULARY = 40, 4096, 13696, 2, 128, 151552

LINEAR_PARAMETERS = LAYERS * (
    HIDDEN * (HIDDEN + 2 * KV_HEADS * HEAD_DIM)  # query, key and value
    + HIDDEN * HIDDEN  # attention output
    + HIDDEN * 2 * MLP  # gate and up
    + MLP * HIDDEN  # down
)
VOCABULARY_PARAMETERS = 2 * VOCABULARY * HIDDEN  # input embedding and output head
KV_VALUES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM  # key and value, each layer

BF16_BYTES = 2.0

# Bytes per linear weight, by vLLM's ``quantization`` (None: the checkpoint's bf16). 4-bit
# methods store a 16-bit scale per group of 128 weights (AWQ a zero point too: 4.25 bits).
LINEAR_WEIGHT_BYTES: dict[str | None, float] = {
    None: BF16_BYTES,
    "fp8": 1.0,  # (vLLM 0.32 names online FP8 fp8_per_tensor; fp8 still works, with a warning)
    "fp8_per_tensor": 1.0,
    "fp8_per_channel": 1.0,
    "fp8_per_block": 1.0,
    "awq": 4.25 / 8,
    "awq_marlin": 4.25 / 8,
    "gptq": 4.125 / 8,
    "gptq_marlin": 4.125 / 8,
}

# Bytes per cached key or value element, by vLLM's ``kv_cache_dtype``.
KV_ELEMENT_BYTES: dict[str, float] = {
    "auto": BF16_BYTES,
    "bfloat16": BF16_BYTES,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
}


def weights_gb(quantization: str | None = None) -> float:
    """The model's weights in GB (10^9 bytes) under ``quantization``."""
    if quantization not in LINEAR_WEIGHT_BYTES:
        known = ", ".join(str(name) for name in LINEAR_WEIGHT_BYTES if name)
        raise ValueError(f"no size known for quantization {quantization!r} (known: {known})")
    linear = LINEAR_PARAMETERS * LINEAR_WEIGHT_BYTES[quantization]
    return (linear + VOCABULARY_PARAMETERS * BF16_BYTES) / 1e9


def least_weights_gb(quantization: str | None = None) -> float:
    """The weights in GB under ``quantization``, or, for a method whose checkpoint alone says how many
    bits it stores (``compressed-tensors``, ``modelopt``, ...), the least any method here takes (4-bit):
    a bound below which a check may refuse a config without knowing the checkpoint."""
    if quantization in LINEAR_WEIGHT_BYTES:
        return weights_gb(quantization)
    return min(weights_gb(method) for method in LINEAR_WEIGHT_BYTES)


def kv_room_gb(memory_gb: float, utilization: float, weights: float) -> float:
    """KV cache room in GB: the share of a GPU's memory vLLM takes, less the weights (activations not counted)."""
    return memory_gb * utilization - weights


def kv_bytes_per_token(kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV cache one token of context takes under ``kv_cache_dtype``."""
    if kv_cache_dtype not in KV_ELEMENT_BYTES:
        raise ValueError(f"no size known for kv_cache_dtype {kv_cache_dtype!r} (known: {', '.join(KV_ELEMENT_BYTES)})")
    return int(KV_VALUES_PER_TOKEN * KV_ELEMENT_BYTES[kv_cache_dtype])
