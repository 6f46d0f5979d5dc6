"""How long one engine step of GLM-4-9B-Chat takes on one H100, and how much KV cache it has.

A decode step is memory bound: the GPU reads all the weights once and every
running sequence's KV cache once, whatever the batch size. A prefill is compute
bound: about 2 FLOP per parameter per prompt token. So one step, which carries
one token for each decoding sequence and chunks of prompts (vLLM's chunked
prefill), takes

    step_launch + (weight bytes + kv_bytes_per_token x context tokens of the step's
                   sequences) / memory_bandwidth + prefill_tokens x prefill_time_per_token

so quantised weights shorten every step and a quantised KV cache both shortens the
reads and holds more tokens (:mod:`serve_app.glm4.sizing`). Prefill is not made
faster by quantisation here: an estimate on the safe side.

The defaults (:class:`serve_app.config.SimulatedEngineConfig`) are estimates from
published figures, not measurements: replace them with a GPU run's.

Runs in each model replica with a simulated engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import SimulatedEngineConfig


@dataclass(frozen=True)
class GpuTiming:
    """Step times and KV capacity of one simulated GPU replica."""

    step_overhead_s: float  # launch and sampling, and reading the weights
    kv_bytes_per_token: int
    memory_bandwidth_bytes_s: float
    prefill_s_per_token: float
    kv_capacity_tokens: int
    max_num_batched_tokens: int

    @classmethod
    def from_config(cls, config: SimulatedEngineConfig) -> GpuTiming:
        weights_gb, kv_bytes_per_token = config.resolved_weights_gb(), config.resolved_kv_bytes_per_token()
        kv_bytes = (config.gpu_memory_gb * config.gpu_memory_utilization - weights_gb) * 1e9
        bandwidth = config.memory_bandwidth_tb_s * 1e12
        return cls(
            step_overhead_s=config.step_launch_ms / 1e3 + weights_gb * 1e9 / bandwidth,
            kv_bytes_per_token=kv_bytes_per_token,
            memory_bandwidth_bytes_s=bandwidth,
            prefill_s_per_token=config.prefill_ms_per_token / 1e3,
            kv_capacity_tokens=int(kv_bytes // kv_bytes_per_token),
            max_num_batched_tokens=config.max_num_batched_tokens,
        )

    def step_s(self, context_tokens: int, prefill_tokens: int) -> float:
        """One step: ``context_tokens`` of KV cache read, ``prefill_tokens`` of prompt computed."""
        kv_read_s = self.kv_bytes_per_token * context_tokens / self.memory_bandwidth_bytes_s
        return self.step_overhead_s + kv_read_s + prefill_tokens * self.prefill_s_per_token

    def decode_tokens_per_s(self, sequences: int, mean_context_tokens: float) -> float:
        """Tokens per second a batch of ``sequences`` decoding at that context length gets, at most."""
        return sequences / self.step_s(round(sequences * mean_context_tokens), 0)
