"""Write a 4-bit weight-only (W4A16) copy of a GLM-4 ``-hf`` checkpoint, for vLLM.

Each linear weight of the decoder layers becomes 4-bit integers with one bf16 scale per group
of 128 (symmetric, round-to-nearest), in compressed-tensors' ``pack-quantized`` format: the
format llm-compressor writes, which vLLM loads with its Marlin kernels on a GPU and its
CPUWNA16 kernels on a CPU. The vocabulary matrices, norms and biases stay bf16. Quantising
and packing are compressed-tensors' own (``calculate_qparams``, ``PackedQuantizationCompressor``);
this file only walks the tensors, one at a time, so a 9B checkpoint needs no more memory than
its largest tensor.

Round-to-nearest needs no calibration data. Calibrated methods (GPTQ, AWQ in llm-compressor)
lose less quality and write the same format; docs/quantisation.md says how to evaluate either.

compressed-tensors and safetensors come with vLLM: the versions its loader reads.

    python -m serve_app.ops.quantise_w4a16 SOURCE_DIR OUT_DIR
    python -m serve_app.ops.quantise_w4a16 THUDM/glm-4-9b-chat-hf OUT_DIR --revision COMMIT

A Hub id is downloaded (huggingface_hub's cache, ``HF_HOME``) at ``--revision``, which must be a
commit: a branch can move, and the checkpoint written would no longer say what it came from.
``OUT_DIR/quantised_from.json`` records the source, its revision and the scheme.

Runs in a shell, offline (`make tiny-model` runs it on the tiny model), never in a Serve replica.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file

ARCHITECTURE = "GlmForCausalLM"  # the -hf checkpoint's; the remote-code one names its tensors otherwise
SCHEME_NAME = "W4A16"  # 4-bit symmetric integer weights, groups of 128, activations bf16
PROVENANCE = "quantised_from.json"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def scheme() -> QuantizationScheme:
    return preset_name_to_scheme(SCHEME_NAME, ["Linear"])


def is_quantised(name: str, tensor: torch.Tensor) -> bool:
    """The decoder layers' linear weights (attention and MLP projections); not the embedding or head."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2


def quantise_linear(weight: torch.Tensor, chosen: QuantizationScheme) -> dict[str, torch.Tensor]:
    """One linear weight as compressed-tensors stores it: ``weight_packed``, ``weight_scale``, ``weight_shape``."""
    args = chosen.weights
    assert args is not None and args.group_size is not None
    rows, columns = weight.shape
    if columns % args.group_size:
        raise ValueError(f"input size {columns} is not a multiple of the group size {args.group_size}")
    groups = weight.float().reshape(rows, columns // args.group_size, args.group_size)
    scale, zero_point = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
    return dict(PackedQuantizationCompressor.compress(state, chosen))


def quantise_checkpoint(source: Path, out: Path) -> Path:
    """Write ``out``: ``source``'s files, its safetensors quantised, its config naming the scheme."""
    config = json.loads((source / "config.json").read_text())
    architectures = config.get("architectures")
    if architectures != [ARCHITECTURE]:
        raise ValueError(
            f"{source} is {architectures}, not {ARCHITECTURE}: quantise the -hf checkpoint "
            "(THUDM/glm-4-9b-chat-hf), whose tensors are named as vLLM's GLM-4 model loads them"
        )
    chosen = scheme()
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, out / path.name)
    weight_map: dict[str, str] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as reader:
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                if is_quantised(name, tensor):
                    prefix = name.removesuffix("weight")
                    tensors |= {prefix + key: value for key, value in quantise_linear(tensor, chosen).items()}
                else:
                    tensors[name] = tensor
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
    if (source / "model.safetensors.index.json").exists():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    quantisation = QuantizationConfig(
        config_groups={"group_0": chosen}, ignore=["lm_head"], format="pack-quantized", quantization_status="compressed"
    )
    config["quantization_config"] = quantisation.model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def source_directory(source: str, revision: str | None) -> tuple[Path, str | None]:
    """A local checkpoint as it is, or a Hub id downloaded at ``revision``, which must be a commit."""
    if Path(source).is_dir():
        return Path(source), revision
    if revision is None or not _COMMIT_RE.match(revision):
        raise ValueError(
            f"{source} is not a directory: name the Hub commit to quantise (--revision, 40 hex characters)"
        )
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision)), revision


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a bf16 GlmForCausalLM checkpoint: a directory, or a Hub id with --revision")
    parser.add_argument("out", type=Path, help="where to write the W4A16 checkpoint")
    parser.add_argument("--revision", help="the Hub commit of a Hub id (recorded for a directory)")
    options = parser.parse_args(argv)
    directory, revision = source_directory(options.source, options.revision)
    out = quantise_checkpoint(directory, options.out)
    provenance = {"source": options.source, "revision": revision, "scheme": SCHEME_NAME, "group_size": 128}
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
