"""A PEFT LoRA adapter on disk -> its low-rank factors in the base model's weight layout (host, numpy).

PEFT writes `adapter_config.json` (peft_type "LORA", r, lora_alpha, use_rslora, target_modules, ...)
and `adapter_model.safetensors` with, per adapted projection of layer i,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the adapted projection is W x + s B A x with s = alpha / r
(alpha / sqrt(r) under rsLoRA). Here A becomes `a` [*in, r] and s B becomes `b` [r, *out] in the
layout of the weight they modify (`model/weights.LayerWeights`: q/k/v [D, H, hd], o [H, hd, D],
gate/up [D, F], down [F, D]), so the forward adds `(x @ a) @ b`.

Anything a LoRA server cannot apply by adding a low-rank product to a q/k/v/o/gate/up/down
projection is refused with an error naming it: other target modules (embeddings, lm_head),
modules_to_save, trained biases, DoRA, per-module rank/alpha patterns, a rank above the server's
maximum, and factors whose shapes do not fit the base model (another base model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.core.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scaling: float
    base_model: str | None
    modules: tuple[str, ...]                                   # adapted projections (subset of MODULES)
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = dataclasses.field(repr=False)
    # (layer, module) -> (a [*in, r], b [r, *out]) float32, the scaling folded into b


def shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """module -> (input dims, output dims) in the base weights' layout."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = (cfg.num_heads, hd), (cfg.num_kv_heads, hd)
    return {"q_proj": ((d,), q), "k_proj": ((d,), kv), "v_proj": ((d,), kv), "o_proj": (q, (d,)),
            "gate_proj": ((d,), (f,)), "up_proj": ((d,), (f,)), "down_proj": ((f,), (d,))}


# module -> (logical axes of its input dims, of its output dims): slots are split like the weight they modify
LOGICAL_AXES = {"q_proj": (("embed",), ("q_heads", "head_dim")), "k_proj": (("embed",), ("kv_heads", "head_dim")),
                "v_proj": (("embed",), ("kv_heads", "head_dim")), "o_proj": (("q_heads", "head_dim"), ("embed",)),
                "gate_proj": (("embed",), ("mlp",)), "up_proj": (("embed",), ("mlp",)),
                "down_proj": (("mlp",), ("embed",))}


def _config(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {cfg['peft_type']!r} is not LORA")
    unsupported = {
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "bias": cfg.get("bias", "none") not in ("none", None),
        "use_dora": bool(cfg.get("use_dora")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"LoRA adapter {path}: {', '.join(f'{k}={cfg.get(k)!r}' for k in bad)} is not supported "
                         "(only low-rank updates of q/k/v/o/gate/up/down projections are served)")
    return cfg


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, name: str | None = None) -> LoraAdapter:
    """Reads and checks a PEFT adapter (a directory, or a hub id in huggingface_hub's local cache)
    against the base model `cfg`; ValueError names the problem."""
    from checkpoints.hf import read_safetensors, resolve_model_dir

    name = name or Path(path).name  # a directory's name, or a hub id's last part
    try:
        path = resolve_model_dir(path, "adapter_config.json", "LoRA adapter")
    except FileNotFoundError as e:
        raise ValueError(f"LoRA adapter {path}: {e}") from None
    meta = _config(path)
    rank = meta.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {path}: rank r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(meta.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors")
    dims = shapes(cfg)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in read_safetensors(file).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULES:
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} adapts a module that is not served "
                             f"(supported target modules: {', '.join(MODULES)})")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} is for layer {layer}; the base model has "
                             f"{cfg.num_layers} layers (an adapter of another base model?)")
        parts.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor.astype(np.float32)
    if not parts:
        raise ValueError(f"LoRA adapter {path}: adapter_model.safetensors holds no LoRA factors")
    factors = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        in_dims, out_dims = dims[module]
        a, b = ab["A"], ab["B"]
        want_a, want_b = (rank, math.prod(in_dims)), (math.prod(out_dims), rank)
        if a.shape != want_a or b.shape != want_b:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)}; this base model needs {list(want_a)} and {list(want_b)} "
                             f"(an adapter of another base model: {meta.get('base_model_name_or_path')!r}?)")
        factors[(layer, module)] = (a.T.reshape(*in_dims, rank), (scaling * b.T).reshape(rank, *out_dims))
    modules = tuple(m for m in MODULES if any(key[1] == m for key in factors))
    return LoraAdapter(name, path, rank, scaling, meta.get("base_model_name_or_path"), modules, factors)
