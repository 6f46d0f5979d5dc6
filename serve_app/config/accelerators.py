"""The GPUs a model replica may ask Ray for, by Ray's own accelerator type names.

A serve config that sets ``ray_actor_options.accelerator_type`` (``H100``, ``A10G``, ...)
places each model replica on a node of that type (Ray detects it on GPU nodes), and
tells :mod:`serve_app.config` what the replica will have: its memory, to check that the
weights and one ``max_model_len`` sequence fit, and its compute capability, to check that it
computes in bfloat16. Types not listed here are not checked; vLLM's own checks at start
remain.

Memory is the device total as the driver reports it (``nvidia-smi``, MiB) in GB (10^9 bytes),
as vLLM's ``gpu_memory_utilization`` takes a share of it. Where Ray's name covers two sizes
(``A100``, ``V100``), the larger: a config is refused only when it cannot fit.

Runs in the application's build, as the config's checks name a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.util.accelerators import accelerators as ray_types

MIB = 2**20


@dataclass(frozen=True)
class Accelerator:
    memory_gb: float
    compute_capability: tuple[int, int]

    @property
    def bfloat16(self) -> bool:
        """bfloat16 arithmetic, which GLM-4 needs (its activations overflow float16): Ampere (8.0) on."""
        return self.compute_capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores (Ada and Hopper, 8.9 on): FP8 weights compute in FP8."""
        return self.compute_capability >= (8, 9)


def _gpu(mib: int, capability: tuple[int, int]) -> Accelerator:
    return Accelerator(round(mib * MIB / 1e9, 1), capability)


ACCELERATORS: dict[str, Accelerator] = {
    ray_types.NVIDIA_TESLA_T4: _gpu(15_360, (7, 5)),
    ray_types.NVIDIA_TESLA_V100: _gpu(32_768, (7, 0)),
    ray_types.NVIDIA_TESLA_A10G: _gpu(23_028, (8, 6)),
    ray_types.NVIDIA_L4: _gpu(23_034, (8, 9)),
    ray_types.NVIDIA_L40S: _gpu(46_068, (8, 9)),
    ray_types.NVIDIA_A100: _gpu(81_920, (8, 0)),
    ray_types.NVIDIA_A100_40G: _gpu(40_960, (8, 0)),
    ray_types.NVIDIA_A100_80G: _gpu(81_920, (8, 0)),
    ray_types.NVIDIA_H100: _gpu(81_559, (9, 0)),
    ray_types.NVIDIA_H200: _gpu(143_771, (9, 0)),
}
