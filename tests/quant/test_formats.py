"""Pre-quantized Hugging Face checkpoints in the layouts no reference packer installs here for: fp8
blocks (DeepSeek / Qwen3-FP8), GPTQ version 2, 8-bit and activation order, and AWQ / GPTQ variants
beyond auto-round's exports. Each is written by our own writer (tests/quant/formats.py, following the
format's published layout), loads to exactly the reference dequantisation of its packed tensors, and
the model's logits equal transformers' on those dequantized weights.

Checkpoints packed and read back by the formats' own libraries (compressed-tensors, auto-round's GPTQ
and AWQ) are tests/quant/test_reference_packers.py: those catch a misreading these writers share.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import jax.numpy as jnp
from checkpoints import load_model
from formats import write_awq, write_fp8_block, write_gptq
from hf_models import make_hf_model
from jaxserve.model import weights as W
from jaxserve.model.dense import forward_dense
from jaxserve.quant import host
from jaxserve.parallel.sharding import make_mesh

WRITERS = {
    "fp8-block": (write_fp8_block, {}, ("fp8-block", "float8_e4m3fn")),
    "awq": (write_awq, {}, ("awq", "uint4")),
    "gptq-v1-sym-4bit": (write_gptq, dict(bits=4, sym=True, version=1), ("gptq", "uint4")),
    "gptq-v1-asym-4bit-g128": (write_gptq, dict(bits=4, group=128, sym=False, version=1), ("gptq", "uint4")),
    "gptq-v2-asym-8bit": (write_gptq, dict(bits=8, sym=False, version=2), ("gptq", "uint8")),
    "gptq-v1-sym-4bit-desc-act": (write_gptq, dict(bits=4, act_order=True), ("gptq", "uint4")),
    "gptq-v2-asym-8bit-desc-act-g128": (write_gptq, dict(bits=8, group=128, sym=False, version=2, act_order=True),
                                        ("gptq", "uint8")),
}
NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
         "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """float32 Qwen3 wide enough for 128-blocks: hidden 256, intermediate 384, 4 heads x 64, 2 KV heads."""
    return make_hf_model("qwen3-untied", tmp_path_factory.mktemp("base"), hidden_size=256, intermediate_size=384,
                         head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def as_torch_layout(leaf, contract: int) -> np.ndarray:
    """A quantized leaf dequantized on the host -> [out, in] like a torch Linear's weight (rows of an
    activation-order leaf put back in input order)."""
    perm = None
    if hasattr(leaf, "perm"):
        leaf, perm = leaf.weight, np.asarray(leaf.perm)
    zero = None if leaf.zero_point is None else np.asarray(leaf.zero_point)
    deq = host.dequantize(np.asarray(leaf.qvalue), np.asarray(leaf.scale), zero)
    deq = deq.reshape(int(np.prod(deq.shape[:contract])), -1)
    if perm is not None:
        restored = np.empty_like(deq)
        restored[perm] = deq
        deq = restored
    return deq.T


def logits_agree(hf_model, reference: dict[str, np.ndarray], cfg, weights) -> None:
    """Our logits == transformers' with every projection set to the reference dequantisation
    (HF module prefix -> float weight [out, in])."""
    model = type(hf_model)(hf_model.config).eval()
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    state.update({f"{k}.weight": torch.from_numpy(np.asarray(v, np.float32)) for k, v in reference.items()})
    model.load_state_dict(state)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 24)).astype(np.int32)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_format_loads_to_its_reference_dequantisation_and_matches_transformers(base, fmt, tmp_path):
    path, hf_model = base
    writer, kwargs, (method, qtype) = WRITERS[fmt]
    expected = writer(path, tmp_path / fmt, **kwargs)
    cfg, weights = load_model(tmp_path / fmt, make_mesh(1, 1))
    assert (cfg.quantization.method, cfg.quantization.qtype) == (method, qtype)
    assert not cfg.quantization.lm_head and not W.is_quantized(weights.lm_head)
    for i, layer in enumerate(weights.layers):
        for field, hf_name in NAMES.items():
            leaf = getattr(layer, field)
            assert W.is_quantized(leaf)
            ours = as_torch_layout(leaf, contract=2 if field == "wo" else 1)
            np.testing.assert_array_equal(ours, expected[f"model.layers.{i}.{hf_name}"], err_msg=f"{i}.{hf_name}")

    logits_agree(hf_model, expected, cfg, weights)


def _with_quantization_config(path, tmp_path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes,message", [
    (dict(quant_method="bitsandbytes"), "'quant_method' 'bitsandbytes' is not supported; supported: fp8, awq, gptq"),
    (dict(bits=3), "GPTQ 'bits' 3 is not supported"),
    (dict(checkpoint_format="marlin"), "GPTQ 'checkpoint_format' 'marlin' is not supported"),
    (dict(group_size=96), "q_proj: 256 input features are not a multiple of the gptq group size 96"),
])
def test_unsupported_method_bits_or_group_is_named(base, tmp_path, changes, message):
    path, _ = base
    write_gptq(path, tmp_path / "q", bits=4)
    _with_quantization_config(tmp_path / "q", tmp_path, **changes)
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace("'", "'")):
        load_model(tmp_path / "q", make_mesh(1, 1))


def test_scattered_g_idx_needs_desc_act(base, tmp_path):
    path, _ = base
    write_gptq(path, tmp_path / "q", bits=4, act_order=True)
    _with_quantization_config(tmp_path / "q", tmp_path, desc_act=False)
    with pytest.raises(ValueError, match="g_idx is not i // group_size although desc_act is false"):
        load_model(tmp_path / "q", make_mesh(1, 1))


def test_quantization_flag_on_a_prequantized_checkpoint_and_a_missing_part_are_errors(base, tmp_path):
    path, _ = base
    write_awq(path, tmp_path / "awq")
    with pytest.raises(ValueError, match="is already quantized \\(awq\\); drop --quantization int8"):
        load_model(tmp_path / "awq", make_mesh(1, 1), quantization="int8")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "awq" / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, str(tmp_path / "awq" / "model.safetensors"))
    with pytest.raises(ValueError, match="has only \\['qweight', 'scales'\\] of 'model.layers.1.mlp.up_proj'; "
                                         "a awq Linear needs qweight, qzeros, scales"):
        load_model(tmp_path / "awq", make_mesh(1, 1))
