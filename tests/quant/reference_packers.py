"""Pre-quantized checkpoints packed by the formats' own libraries, not by us.

- compressed-tensors: its quantization lifecycle (apply a preset scheme, compute each Linear's
  scale and zero point with its `calculate_qparams` from the weight's min and max, compress, save),
  which is what llm-compressor's round-to-nearest path does before its `save_pretrained`.
- GPTQ and AWQ: auto-round's round-to-nearest export (`iters=0`) to the `auto_gptq` and `auto_awq`
  formats, run in a child process (auto-round patches transformers when imported). The same child
  dequantizes what it wrote with auto-round's own readers of those formats (its CPU GPTQ
  QuantLinear, its AWQ `dequantize_gemm`): the float weights the checkpoint means.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file

from jaxserve.default_model import ensure_default_model


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max each scale covers, in the shape compressed-tensors gives its scale."""
    o, i = w.shape
    if args.strategy == "group":
        g = w.reshape(o, i // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy == "block":
        bo, bi = args.block_structure
        b = w.reshape(o // bo, bo, i // bi, bi)
        return b.amin((1, 3)), b.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def pack_compressed_tensors(src: Path, dst: Path, scheme: str | dict) -> None:
    """Quantizes every Linear but lm_head with a compressed-tensors preset scheme (W4A16, FP8_BLOCK...)
    or a scheme's weight arguments (a dict of QuantizationArgs fields)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = (preset_name_to_scheme(scheme, ["Linear"]) if isinstance(scheme, str) else
              QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**scheme)))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            scale, zero = calculate_qparams(*_minmax(module.weight, args), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # static activation scales: not used by weight-only serving
                module.input_scale.fill_(1.0)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))


def dequantized_by_compressed_tensors(path: Path) -> dict[str, torch.Tensor]:
    """transformers' compressed-tensors loader, decompressing: the float state dict the format means."""
    config = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    return {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}


def pack_auto_round(src: Path, dst: Path, fmt: str, sym: bool, bits: int = 4,
                    group: int = 64) -> tuple[Path, dict[str, np.ndarray]]:
    """auto-round's RTN export of `src` in `fmt` (auto_gptq, auto_awq) -> (the checkpoint's folder,
    HF module prefix -> the float32 weight [out, in] auto-round reads back from it)."""
    work = dst / "src"
    shutil.copytree(src, work)
    tokenizer = ensure_default_model()  # auto-round insists on a tokenizer; RTN never runs it
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer / name, work / name)
    subprocess.run([sys.executable, __file__, str(work), str(dst / "out"), fmt, str(int(sym)), str(bits), str(group)],
                   check=True, capture_output=True, timeout=600)
    (out,) = (d for d in (dst / "out").iterdir() if d.is_dir())
    return out, dict(np.load(dst / "out" / "reference.npz"))


def _auto_round_main(src: str, out: str, fmt: str, sym: str, bits: str, group: str) -> None:
    from auto_round import AutoRound

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    rounder = AutoRound(model, tokenizer=tokenizer, bits=int(bits), group_size=int(group), sym=sym == "1",
                        iters=0, disable_opt_rtn=True, device_map="cpu")
    rounder.quantize_and_save(out, format=fmt)
    (folder,) = (d for d in Path(out).iterdir() if d.is_dir())
    tensors = load_file(str(folder / "model.safetensors"))
    reference = {}
    for name in tensors:
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            reference[prefix] = _auto_round_dequantize(tensors, prefix, fmt, int(bits), int(group))
    np.savez(Path(out) / "reference.npz", **reference)


def _auto_round_dequantize(tensors: dict[str, torch.Tensor], prefix: str, fmt: str, bits: int,
                           group: int) -> np.ndarray:
    """One packed Linear -> its float32 weight [out, in], by auto-round's readers of the format."""
    qweight, qzeros, scales = (tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales"))
    if fmt == "auto_awq":
        from auto_round.export.export_to_awq.utils import dequantize_gemm
        return dequantize_gemm(qweight, qzeros, scales.float(), bits, group).T.numpy()
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear  # GPTQ v1: zero points stored minus one
    layer = QuantLinear(bits, group, scales.shape[0] * group, scales.shape[1], bias=False)
    layer.load_state_dict({"qweight": qweight, "qzeros": qzeros, "scales": scales}, strict=False)
    with torch.no_grad():
        return layer(torch.eye(layer.infeatures, dtype=torch.float16)).float().T.numpy()


if __name__ == "__main__":
    _auto_round_main(*sys.argv[1:])
