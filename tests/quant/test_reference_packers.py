"""Pre-quantized checkpoints packed by the formats' own libraries load to what those libraries read
back from them, and serve logits equal to transformers' on those weights.

Our own writers (tests/quant/formats.py) share our reading of each layout, so a misreading would
pass there; here both the packing and the reading back are the reference library's:
compressed-tensors packs (its presets, from int4 groups to 128x128 fp8 blocks) and transformers'
compressed-tensors loader decompresses; auto-round packs GPTQ and AWQ and its own CPU readers of
those formats dequantize (tests/quant/reference_packers.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints import load_model
from hf_models import make_hf_model
from jaxserve.parallel.sharding import make_mesh
from reference_packers import dequantized_by_compressed_tensors, pack_auto_round, pack_compressed_tensors
from test_formats import NAMES, as_torch_layout, logits_agree

# compressed-tensors preset (or weight arguments) -> (the storage type we declare, its checkpoint format)
CT_SCHEMES = {
    "W4A16": ("int4", "pack-quantized"),            # int4, groups of 128, symmetric
    "W4A16_ASYM": ("int4", "pack-quantized"),       # int4, groups of 128, zero points
    "W8A16": ("int8", "pack-quantized"),            # int8, groups of 128
    "W8A8": ("int8", "int-quantized"),              # int8 per channel (activations dynamic: not ours to apply)
    "W4AFP8": ("int4", "int-quantized"),            # int4 values one per int8, groups of 128
    "FP8": ("float8_e4m3fn", "float-quantized"),    # one scale per tensor
    "FP8_DYNAMIC": ("float8_e4m3fn", "float-quantized"),  # per channel
    "FP8_BLOCK": ("float8_e4m3fn", "float-quantized"),    # 128x128 blocks
    "int8-channel-packed": ("int8", "pack-quantized"),
}
CUSTOM = {"int8-channel-packed": dict(num_bits=8, type="int", symmetric=True, strategy="channel")}
# (auto-round export format, symmetric) -> our method
AUTO_ROUND = {("auto_gptq", True): "gptq", ("auto_gptq", False): "gptq", ("auto_awq", False): "awq"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """float32 Qwen3 whose every projection splits into 128-wide groups and blocks."""
    return make_hf_model("qwen3-untied", tmp_path_factory.mktemp("base"), hidden_size=256, intermediate_size=384,
                         head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def _our_weights(weights) -> dict[str, np.ndarray]:
    """HF module prefix -> our loaded projection dequantized on the host, [out, in] like torch."""
    return {f"model.layers.{i}.{hf}": as_torch_layout(getattr(layer, field), contract=2 if field == "wo" else 1)
            for i, layer in enumerate(weights.layers) for field, hf in NAMES.items()}


@pytest.mark.parametrize("preset", list(CT_SCHEMES))
def test_compressed_tensors_packed_checkpoint_reads_as_compressed_tensors_reads_it(base, preset, tmp_path):
    path, hf_model = base
    pack_compressed_tensors(path, tmp_path / preset, CUSTOM.get(preset, preset))
    reference = dequantized_by_compressed_tensors(tmp_path / preset)
    cfg, weights = load_model(tmp_path / preset, make_mesh(1, 1))
    assert (cfg.quantization.method, cfg.quantization.qtype, cfg.quantization.checkpoint_format) == (
        "compressed-tensors", *CT_SCHEMES[preset])
    ours = _our_weights(weights)
    for prefix, w in ours.items():
        expected = reference[f"{prefix}.weight"].numpy()
        np.testing.assert_allclose(w, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max(), err_msg=prefix)
    logits_agree(hf_model, ours, cfg, weights)


@pytest.mark.parametrize("fmt,sym", list(AUTO_ROUND))
def test_auto_round_packed_checkpoint_reads_as_auto_round_reads_it(base, fmt, sym, tmp_path):
    path, hf_model = base
    folder, reference = pack_auto_round(path, tmp_path, fmt, sym)
    cfg, weights = load_model(folder, make_mesh(1, 1))
    assert (cfg.quantization.method, cfg.quantization.qtype, cfg.quantization.group_size) == (
        AUTO_ROUND[fmt, sym], "uint4", 64)
    ours = _our_weights(weights)
    assert set(ours) == set(reference)
    for prefix, w in ours.items():
        # auto-round's GPTQ reader computes (q - zero) * scale in float16: one half-ulp of the product
        np.testing.assert_allclose(w, reference[prefix], rtol=1e-3, atol=1e-3 * np.abs(w).max(), err_msg=prefix)
    # The forward is judged on the weights we read (just shown equal to auto-round's up to that half-ulp):
    # transformers on auto-round's float16 products differs from ours by ~4e-4 of the logits' range on
    # some CPUs (AMD EPYC), more than logits_agree's 1e-4.
    logits_agree(hf_model, ours, cfg, weights)
