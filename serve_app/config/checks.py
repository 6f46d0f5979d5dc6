"""Checks of a serve config against the libraries it names: vLLM's arguments, the GPU table, Ray's options.

Runs in the application's build, which validates the config, and in each replica as it reads its
arguments; none imports vLLM (its argument names are read from its source,
:mod:`serve_app.vllm_internals`) so the build stays light.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from serve_app.glm4 import sizing
from serve_app.glm4.format import check_dtype
from serve_app.vllm_internals import engine_argument_names, kv_cache_dtypes, quantization_methods


@functools.cache
def vllm_argument_names() -> tuple[frozenset[str], frozenset[str]]:
    """Names of vLLM's engine arguments and of its OpenAI front-end arguments (read from vLLM's
    source, not imported: the application's build stays light, serve_app.vllm_internals)."""
    return engine_argument_names()


def split_engine_args(engine_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``engine_args`` into (engine, front-end) keyword arguments.

    vLLM's own CLI mixes both kinds (``--max-model-len`` and ``--chat-template``);
    the config does too, and this is the one place that tells them apart.
    """
    engine_names, frontend_names = vllm_argument_names()
    engine = {k: v for k, v in engine_args.items() if k in engine_names}
    frontend = {k: v for k, v in engine_args.items() if k in frontend_names and k not in engine}
    return engine, frontend


_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def check_quantisation(engine_args: dict[str, Any]) -> None:
    """``quantization`` and ``kv_cache_dtype`` are values vLLM knows (its own lists), named at
    config time rather than when a replica builds its engine; a float16 KV cache is refused as
    float16 activations are (GLM-4's values overflow it). Whether the GPU runs the method
    (FP8 needs compute capability 8.9 for its fast path) vLLM checks as it builds its config,
    before any weight loads."""
    methods, cache_dtypes = quantization_methods(), kv_cache_dtypes()
    method = engine_args.get("quantization")
    if method is not None and method not in methods:
        raise ValueError(f"quantization {method!r} is not one of vLLM's methods ({', '.join(methods)})")
    cache_dtype = engine_args.get("kv_cache_dtype", "auto")
    if cache_dtype not in cache_dtypes:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not one of vLLM's ({', '.join(cache_dtypes)})")
    try:
        check_dtype(cache_dtype)
    except ValueError as refused:
        raise ValueError(f"kv_cache_dtype: {refused}") from None


def check_remote_code_is_pinned(engine_args: dict[str, Any]) -> None:
    """With ``trust_remote_code``, the checkpoint's own code runs in every replica: it must come
    from a commit, not a branch or tag (or the default branch), which can change under a running
    deployment so that the next replica to start runs other code. A local directory is exempt:
    what was deployed is what runs."""
    if not engine_args.get("trust_remote_code") or Path(str(engine_args["model"])).is_dir():
        return
    # revision is required; code_revision and tokenizer_revision default to it.
    pins = {"revision": engine_args.get("revision")} | {
        name: engine_args[name] for name in ("code_revision", "tokenizer_revision") if engine_args.get(name) is not None
    }
    loose = [name for name, value in pins.items() if not _COMMIT_RE.match(str(value))]
    if loose:
        raise ValueError(
            "trust_remote_code runs the checkpoint's code in every replica: pin "
            + ", ".join(loose)
            + " to a commit (40 hexadecimal characters), not a branch or tag"
        )


# vLLM's FP8 methods that need FP8 arithmetic: on a GPU without it, vLLM's other FP8 methods run
# as FP8 weights computed in bfloat16 (Marlin), this one fails once its weights are loaded.
FP8_COMPUTE_ONLY = frozenset({"fp8_per_channel"})


def check_fits_accelerator(engine_args: dict[str, Any], accelerator_type: str) -> None:
    """The GPU a replica asks Ray for (``ray_actor_options.accelerator_type``) can run GLM-4-9B as
    configured: it computes in bfloat16 (and in FP8 where the method needs it), and its memory
    holds the weights and the KV cache of one ``max_model_len`` sequence at
    ``gpu_memory_utilization``. Sizes are GLM-4-9B's
    (:mod:`serve_app.glm4.sizing`); activations are not counted, so a config refused here cannot
    start, and one passed may still be refused by vLLM's memory profile as the replica starts.
    A type :data:`serve_app.config.accelerators.ACCELERATORS` does not list is not checked."""
    from serve_app.config.accelerators import ACCELERATORS

    gpu = ACCELERATORS.get(accelerator_type)
    if gpu is None:
        return
    if not gpu.bfloat16:
        major, minor = gpu.compute_capability
        raise ValueError(
            f"accelerator_type {accelerator_type} (compute capability {major}.{minor}) has no bfloat16, which "
            "GLM-4 computes in (float16 overflows), FP8 and 4-bit weights included: it needs 8.0 (Ampere) or later"
        )
    quantization = engine_args.get("quantization")
    if quantization in FP8_COMPUTE_ONLY and not gpu.fp8:
        raise ValueError(
            f"quantization {quantization} computes in FP8, which accelerator_type {accelerator_type} has no "
            "tensor cores for (compute capability 8.9 or later: L4, L40S, H100, H200); fp8_per_tensor runs there "
            "as FP8 weights with bfloat16 arithmetic (vLLM's Marlin kernel)"
        )
    kv_dtype = engine_args.get("kv_cache_dtype") or "auto"
    if "max_model_len" not in engine_args or kv_dtype not in sizing.KV_ELEMENT_BYTES:
        return
    weights = sizing.least_weights_gb(quantization)
    room = sizing.kv_room_gb(gpu.memory_gb, float(engine_args.get("gpu_memory_utilization", 0.9)), weights)
    needed = int(engine_args["max_model_len"]) * sizing.kv_bytes_per_token(kv_dtype) / 1e9
    if room < needed:
        fits = max(0, int(room * 1e9 / sizing.kv_bytes_per_token(kv_dtype)))
        raise ValueError(
            f"on {accelerator_type} ({gpu.memory_gb:g} GB) at gpu_memory_utilization "
            f"{engine_args.get('gpu_memory_utilization', 0.9)}, {weights:.1f} GB of weights "
            f"(quantization {quantization}) leave {max(room, 0):.1f} GB for the KV cache, before activations; one "
            f"max_model_len {engine_args['max_model_len']} sequence needs {needed:.1f} GB (kv_cache_dtype "
            f"{kv_dtype}): lower max_model_len below {fits}, or quantise the weights or the KV cache"
        )


def validate_deployment_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check Ray Serve deployment options with Ray's own models; return them unchanged."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema

    if "name" in options:
        raise ValueError("'name' is set by the application; remove it")
    try:
        DeploymentSchema(name="deployment", **options)
        # The schema keeps autoscaling_config as a plain mapping; check its fields too.
        if isinstance(options.get("autoscaling_config"), dict):
            AutoscalingConfig(**options["autoscaling_config"])
    except ValidationError as exc:
        where = "autoscaling_config." if exc.title == "AutoscalingConfig" else ""
        problems = "; ".join(where + ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in exc.errors())
        raise ValueError(problems) from None
    return options
