"""Writers of pre-quantized checkpoints, following each format's published layout, for the loader's tests.

Each writer takes a float32 model directory written by transformers and writes a copy whose Linear
projections (q/k/v/o, gate/up/down) are stored in the format, and returns, per projection, the
float32 weight [out, in] that the stored tensors dequantize to (the format's reference
dequantisation, computed here from the packed values).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # the last four: latent attention
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(values: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Unsigned values -> int32 words of 32 / bits values (lowest bits first) along `axis`;
    field i of a word holds value order[i] of its group."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(per):
        words |= v[..., i] << np.uint32(bits * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def _write(src: Path, dst: Path, quantization_config: dict,
           quantize: Callable[[str, np.ndarray], tuple[dict[str, torch.Tensor], np.ndarray]]) -> dict[str, np.ndarray]:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    expected: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):  # each file rewritten under its own name
        tensors: dict[str, torch.Tensor] = {}
        for name, w in load_file(str(file)).items():
            if _is_projection(name):
                prefix = name[: -len(".weight")]
                stored, deq = quantize(prefix, w.astype(np.float32))
                tensors.update({f"{prefix}.{k}": v for k, v in stored.items()})
                expected[prefix] = deq
            else:
                tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
        save_file(tensors, str(dst / file.name))
    return expected


def _groups(w: np.ndarray, g: int) -> np.ndarray:
    """[O, I] -> [O, I / g, g]"""
    return w.reshape(w.shape[0], w.shape[1] // g, g)


def write_fp8_block(src: Path, dst: Path, block: int = 128) -> dict[str, np.ndarray]:
    """Blocks of block x block; an axis that is not a multiple ends in a partial block (ceil), as
    DeepSeek-V3 stores its 576-row kv_a_proj_with_mqa."""
    def quantize(prefix, w):
        o, i = w.shape
        po, pi = -(-o // block) * block, -(-i // block) * block
        tiles = np.pad(w, ((0, po - o), (0, pi - i))).reshape(po // block, block, pi // block, block)
        scale = (np.abs(tiles).max(axis=(1, 3)) / 448.0).astype(np.float32)         # [ceil(O/b), ceil(I/b)]
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:o, :i]
        q = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
        deq = q.to(torch.float32).numpy() * full
        return {"weight": q, "weight_scale_inv": torch.from_numpy(scale)}, deq
    return _write(src, dst, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [block, block], "modules_to_not_convert": ["lm_head"]}, quantize)


def _asym(w: np.ndarray, g: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max group quantization of [O, I] -> (q [O, I], zero [O, I/g], scale [O, I/g] fp16)."""
    top = (1 << bits) - 1
    grp = _groups(w, g)
    lo, hi = np.minimum(grp.min(-1), 0), np.maximum(grp.max(-1), 0)
    scale = ((hi - lo) / top).astype(np.float16)
    s32 = scale.astype(np.float32)
    zero = np.clip(np.rint(-lo / s32), 0, top)
    q = np.clip(np.rint(grp / s32[..., None]) + zero[..., None], 0, top)
    return q.reshape(w.shape).astype(np.uint32), zero.astype(np.uint32), scale


def _deq(q: np.ndarray, zero: np.ndarray, scale: np.ndarray, g: int) -> np.ndarray:
    return ((_groups(q.astype(np.float32), g) - zero.astype(np.float32)[..., None])
            * scale.astype(np.float32)[..., None]).reshape(q.shape)


def write_awq(src: Path, dst: Path, group: int = 64) -> dict[str, np.ndarray]:
    def quantize(prefix, w):
        q, zero, scale = _asym(w, group, 4)
        return {"qweight": torch.from_numpy(pack_int32(q.T, 4, axis=1, order=AWQ_ORDER)),
                "qzeros": torch.from_numpy(pack_int32(zero.T, 4, axis=1, order=AWQ_ORDER)),
                "scales": torch.from_numpy(np.ascontiguousarray(scale.T))}, _deq(q, zero, scale, group)
    return _write(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                             "version": "gemm", "modules_to_not_convert": None}, quantize)


def write_gptq(src: Path, dst: Path, bits: int = 4, group: int = 64, sym: bool = True,
               version: int = 1, act_order: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    mask = (1 << bits) - 1

    def quantize_grouped(w):
        """[O, I] with contiguous groups -> (q [O, I], the zero readers compute, stored zero, scale fp16)."""
        if sym:  # symmetric: the zero is the middle of the unsigned range
            mid = 1 << (bits - 1)
            grp = _groups(w, group)
            scale = (np.abs(grp).max(-1) / (mid - 1)).astype(np.float16)
            zero = np.full(scale.shape, mid, np.int64)
            q = np.clip(np.rint(grp / scale.astype(np.float32)[..., None]) + mid, 0, mask)
            q = q.reshape(w.shape).astype(np.uint32)
        else:
            q, zero, scale = _asym(w, group, bits)
        stored_zero = ((zero.astype(np.int64) - (1 if version == 1 else 0)) & mask).astype(np.uint32)
        read_zero = stored_zero + 1 if version == 1 else stored_zero  # v1 readers add 1 (a zero of 0 reads 16)
        return q, read_zero, stored_zero, scale

    def quantize(prefix, w):
        """With act_order, input features join groups in a random order (g_idx), as GPTQ's
        desc_act does: quantize the columns sorted by group, store them back in input order."""
        i = w.shape[1]
        order = rng.permutation(i) if act_order else np.arange(i)
        g_idx = np.empty(i, np.int32)
        g_idx[order] = np.arange(i) // group
        q_sorted, read_zero, stored_zero, scale = quantize_grouped(w[:, order])
        q = np.empty_like(q_sorted)
        q[:, order] = q_sorted
        deq = np.empty(w.shape, np.float32)
        deq[:, order] = _deq(q_sorted, read_zero, scale, group)
        return {"qweight": torch.from_numpy(pack_int32(q.T, bits, axis=0)),
                "qzeros": torch.from_numpy(pack_int32(stored_zero.T, bits, axis=1)),
                "scales": torch.from_numpy(np.ascontiguousarray(scale.T)),
                "g_idx": torch.from_numpy(g_idx)}, deq
    return _write(src, dst, {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                             "sym": sym, "checkpoint_format": "gptq" if version == 1 else "gptq_v2"}, quantize)
