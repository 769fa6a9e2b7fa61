"""The MTP layer a DeepSeek-V3 / Kimi K2 / GLM-4.5 checkpoint stores after its decoder -> (MtpConfig,
MtpWeights).

The layer is `model.layers.{num_hidden_layers}.*` in the served checkpoint itself: `enorm`, `hnorm`,
`eh_proj` [D, 2D], `shared_head.norm`, and a decoder layer named as the decoder's are (attention,
norms, router, experts). Its `embed_tokens` and `shared_head.head` are copies of the model's own
embeddings and lm_head, which the head shares instead of holding twice (DeepSeek-V3 trained them
shared): those two are not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from checkpoints import quantized
from checkpoints.hf import _gathered_experts, _get, _header, _iter_tensors, _safetensors_files, resolve_model_dir
from checkpoints.hf_names import name_table, unfused
from jaxserve.core.config import ModelConfig
from jaxserve.model import mtp
from jaxserve.model.param_spec import is_spec
from jaxserve.parallel import sharding

_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the model's own


def _table(cfg: mtp.MtpConfig) -> dict[str, tuple[tuple[Any, ...], Callable[[np.ndarray], np.ndarray]]]:
    """Tensor name after `model.layers.{N}.` -> (path into MtpWeights, transform from the stored array)."""
    ident = lambda t: t  # noqa: E731
    table: dict[str, tuple[tuple[Any, ...], Callable]] = {
        "enorm.weight": (("enorm",), ident), "hnorm.weight": (("hnorm",), ident),
        "eh_proj.weight": (("eh_proj",), lambda t: t.T), "shared_head.norm.weight": (("final_norm",), ident)}
    layer_prefix = "model.layers.0."
    for name, (path, transform) in name_table(cfg.layer).items():
        if name.startswith(layer_prefix):  # ("layers", 0, field[, expert]) -> ("layer", field[, expert])
            table[name[len(layer_prefix):]] = (("layer", *path[2:]), transform)
    return table


def load_mtp(model: str | Path, target: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32,
             rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[mtp.MtpConfig, mtp.MtpWeights]:
    """Config and placed weights of the MTP layer of the checkpoint in `model` (the served one)."""
    model_dir = resolve_model_dir(model)
    cfg = mtp.MtpConfig.of(target)
    specs = mtp.abstract(cfg, dtype)
    axis_rules = sharding.rules_for(mtp.logical_dims(cfg), mesh, rules)
    placements = jax.tree.map(lambda s: sharding.named(mesh, *s.axes, rules=axis_rules, shape=s.shape), specs,
                              is_leaf=is_spec)
    table, prefix = _table(cfg), f"model.layers.{target.num_layers}."
    out: dict[tuple[Any, ...], Any] = {}
    experts: dict[tuple[Any, ...], dict[int, np.ndarray]] = {}
    files = _safetensors_files(model_dir)
    # an fp8-block checkpoint's MTP Linears (the head holds them plain): dequantized as they are read
    scaled = {p for p in quantized.scaled_modules(lambda: (n for f in files for n in _header(f)[1]), target.quantization)
              if p.startswith(prefix)}
    tensors = quantized.widened(_iter_tensors(files), scaled, target.quantization)
    for name, read in unfused(tensors, cfg.layer):
        if not name.startswith(prefix):
            continue  # the decoder's own tensors
        key = name[len(prefix):]
        if key in _SHARED:
            continue
        if key not in table:
            raise ValueError(f"unexpected tensor {name!r} in the MTP layer of {model_dir}")
        path, transform = table[key]
        expert = path[2] if len(path) == 3 else None
        leaf = path[:2] if expert is not None else path
        spec, placement = _get(specs, leaf), _get(placements, leaf)
        raw = read()
        host = np.ascontiguousarray(transform(raw))
        shape = spec.shape[1:] if expert is not None else spec.shape
        if host.shape != shape:
            raise ValueError(f"MTP tensor {name!r} has shape {tuple(raw.shape)} (as {host.shape} after layout), "
                             f"expected {shape} from config.json")
        if expert is not None:
            host = _gathered_experts(experts, leaf, expert, host, spec.shape[0])
            if host is None:
                continue
        out[leaf] = jax.device_put(host.astype(jnp.dtype(spec.dtype)), placement)
    wanted = {path[:2] if len(path) == 3 else path for path, _ in table.values()}
    missing = sorted(".".join(map(str, p)) for p in wanted - set(out))
    if missing:
        raise ValueError(f"the checkpoint in {model_dir} has no complete MTP layer (model.layers."
                         f"{target.num_layers}.*): missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    layer = specs.layer.replace(**{f: out.get(("layer", f)) for f in specs.layer.__dataclass_fields__})
    return cfg, mtp.MtpWeights(enorm=out[("enorm",)], hnorm=out[("hnorm",)], eh_proj=out[("eh_proj",)], layer=layer,
                               final_norm=out[("final_norm",)])

