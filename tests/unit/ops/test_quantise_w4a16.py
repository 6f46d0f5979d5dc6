"""serve_app/ops/quantise_w4a16.py: the tiny model's 4-bit copy holds what vLLM's W4A16 loader reads.

The e2e test (tests/e2e/test_quantised_serving.py) serves the copy on vLLM's CPU engine; here,
its tensors: each decoder projection rounded to the nearest of 16 levels of its group's scale,
everything else as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from safetensors import safe_open

from serve_app.ops.quantise_w4a16 import PROVENANCE, main, quantise_checkpoint, scheme

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny-glm4"


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as reader:
        return {name: reader.get_tensor(name) for name in reader.keys()}


@pytest.fixture(scope="module")
def quantised(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantise_checkpoint(TINY, tmp_path_factory.mktemp("w4a16") / "tiny-w4a16")


def test_the_config_names_compressed_tensors_w4a16_and_keeps_the_head_bf16(quantised: Path) -> None:
    config = json.loads((quantised / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"], config["quantization_status"]) == (
        "compressed-tensors",
        "pack-quantized",
        "compressed",
    )
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["group_size"]) == (4, "int", True, 128)
    assert config["ignore"] == ["lm_head"]
    assert (quantised / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()


def test_each_projection_is_its_weights_rounded_to_16_levels_of_its_groups_scale(quantised: Path) -> None:
    original, written = tensors(TINY), tensors(quantised)
    projections = [name for name in original if name.endswith("_proj.weight")]
    assert len(projections) == 2 * 6  # q, k, v, o, gate_up and down, in each of 2 layers
    for name in projections:
        prefix = name.removesuffix("weight")
        weight = original[name]
        assert name not in written and prefix + "weight_zero_point" not in written  # symmetric: no zero point
        packed, scale = written[prefix + "weight_packed"], written[prefix + "weight_scale"]
        assert packed.dtype == torch.int32 and packed.shape == (weight.shape[0], weight.shape[1] // 8)
        assert scale.shape == (weight.shape[0], weight.shape[1] // 128)
        state = {key: written[prefix + key] for key in ("weight_packed", "weight_scale", "weight_shape")}
        restored = PackedQuantizationCompressor.decompress(state, scheme())["weight"].float()
        step = scale.float().repeat_interleave(128, dim=1)
        error = (restored - weight.float()).abs()
        # Round to nearest: half a step, and the scale's bf16 rounding (7 mantissa bits) at the
        # outermost of the 8 levels each side; a wrong level would be off by a whole step.
        assert (error <= step * (0.5 + 8 * 2**-7)).all(), name
        assert error.max() > 0, name  # it was quantised


def test_everything_else_is_kept_bit_for_bit(quantised: Path) -> None:
    original, written = tensors(TINY), tensors(quantised)
    kept = [name for name in original if not name.endswith("_proj.weight")]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(kept)
    for name in kept:
        assert torch.equal(written[name], original[name]), name


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    """The remote-code checkpoint (ChatGLMForConditionalGeneration) names its tensors otherwise."""
    source = tmp_path / "remote-code"
    shutil.copytree(TINY, source)
    config = json.loads((source / "config.json").read_text()) | {"architectures": ["ChatGLMForConditionalGeneration"]}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"ChatGLMForConditionalGeneration.*not GlmForCausalLM.*-hf checkpoint"):
        quantise_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_records_what_it_quantised(tmp_path: Path) -> None:
    main([str(TINY), str(tmp_path / "out"), "--revision", "a" * 40])
    provenance = json.loads((tmp_path / "out" / PROVENANCE).read_text())
    assert provenance == {"source": str(TINY), "revision": "a" * 40, "scheme": "W4A16", "group_size": 128}


@pytest.mark.parametrize("revision", [None, "main", "v1.0"])
def test_a_hub_checkpoint_is_quantised_only_at_a_commit(tmp_path: Path, revision: str | None) -> None:
    """A branch or tag can move: the checkpoint written would no longer say what it came from."""
    argv = ["THUDM/glm-4-9b-chat-hf", str(tmp_path / "out")] + (["--revision", revision] if revision else [])
    with pytest.raises(ValueError, match=r"name the Hub commit to quantise \(--revision, 40 hex"):
        main(argv)
    assert not (tmp_path / "out").exists()
