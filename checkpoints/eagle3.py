"""An EAGLE-3 head in the Hugging Face layout its authors publish -> (Eagle3Config, Eagle3Weights).

A head directory holds config.json (`LlamaForCausalLMEagle3`, `draft_vocab_size`, optionally
`eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with:
    fc.weight [D, 3 Dt]; midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight;
    midlayer.self_attn.{q,k,v}_proj.weight [.., 2 D]; midlayer.self_attn.o_proj.weight;
    midlayer.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [Vd, D];
    d2t [Vd] (target id - draft id); t2d [V] (unused); embed_tokens.weight (optional).
Exporters also write the layer as `layers.0.` and put a `model.` prefix on everything but lm_head;
both read the same. Pickled `pytorch_model.bin` heads need torch to read: convert them to
safetensors first (the error says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from checkpoints.hf import _iter_tensors, _safetensors_files, resolve_model_dir, tensor_names
from checkpoints.hf_names import layer_tensors
from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.model import eagle3
from jaxserve.model.param_spec import is_spec

_LAYER_PREFIXES = ("midlayer.", "layers.0.")


def _canonical(name: str) -> str:
    """The tensor name without the exporter's `model.` prefix, its layer as `midlayer.`."""
    name = name.removeprefix("model.")
    for prefix in _LAYER_PREFIXES[1:]:
        if name.startswith(prefix):
            return _LAYER_PREFIXES[0] + name[len(prefix):]
    return name


def _table(cfg: eagle3.Eagle3Config) -> dict[str, tuple[tuple[str, ...], Callable[[np.ndarray], Any]]]:
    """Canonical tensor name -> (path into Eagle3Weights, transform from the stored array)."""
    c, vdp = cfg.layer, cfg.padded_draft_vocab
    ident = lambda t: t  # noqa: E731
    transpose = lambda t: t.T  # noqa: E731

    def pad(rows: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda t: np.pad(t, ((0, rows - t.shape[0]),) + ((0, 0),) * (t.ndim - 1))

    table: dict[str, tuple[tuple[str, ...], Callable]] = {
        "fc.weight": (("fc",), transpose),
        "midlayer.hidden_norm.weight": (("hidden_norm",), ident),
        "norm.weight": (("final_norm",), ident),
        "lm_head.weight": (("lm_head",), lambda t: pad(vdp)(t).T),
    }
    if cfg.has_d2t:  # stored as offsets: target id = draft id + d2t[draft id]
        table["d2t"] = (("d2t",), lambda t: pad(vdp)(np.arange(t.shape[0]) + t).astype(np.int32))
    if cfg.has_embed:
        table["embed_tokens.weight"] = (("embed",), pad(c.padded_vocab_size))
    for suffix, (field, fn) in layer_tensors(c).items():  # the layer is a llama layer reading 2D features
        table["midlayer." + suffix] = (("layer", field), fn)
    return table


def read_config(model: str | Path, target: ModelConfig) -> tuple[Path, eagle3.Eagle3Config]:
    """The head's directory (a local one or a cached hub id) and its checked configuration."""
    model_dir = resolve_model_dir(model, what="EAGLE-3 head")
    if not list(model_dir.glob("*.safetensors")) and list(model_dir.glob("*.bin")):
        raise ValueError(f"{model_dir} holds a pickled PyTorch checkpoint; jaxserve reads safetensors only "
                         "(save it again with safetensors.torch.save_file on a machine with torch)")
    raw = json.loads((model_dir / "config.json").read_text())
    names = {_canonical(n) for n in tensor_names(model_dir)}
    return model_dir, eagle3.Eagle3Config.from_hf(raw, target, names)


def load_eagle3(model: str | Path, target: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[eagle3.Eagle3Config, eagle3.Eagle3Weights]:
    """Config and placed weights of an EAGLE-3 head for `target`; errors name the offending tensor."""
    model_dir, cfg = read_config(model, target)
    specs = eagle3.abstract(cfg, dtype)
    rules = sharding.rules_for(eagle3.logical_dims(cfg), mesh, rules)
    placements = jax.tree.map(lambda s: sharding.named(mesh, *s.axes, rules=rules, shape=s.shape), specs,
                              is_leaf=is_spec)
    table = _table(cfg)
    out: dict[tuple[str, ...], Any] = {}
    for name, read in _iter_tensors(_safetensors_files(model_dir)):
        key = _canonical(name)
        if key == "t2d" or (key == "d2t" and not cfg.has_d2t):
            continue
        if key not in table:
            raise ValueError(f"unexpected tensor {name!r} in the EAGLE-3 head {model_dir}")
        path, transform = table[key]
        spec, placement = _get(specs, path), _get(placements, path)
        raw = read()
        host = np.ascontiguousarray(transform(raw))
        if host.shape != spec.shape:
            raise ValueError(f"EAGLE-3 tensor {name!r} has shape {tuple(raw.shape)} (as {host.shape} after "
                             f"layout), expected {spec.shape} from config.json")
        out[path] = jax.device_put(host.astype(jnp.dtype(spec.dtype)), placement)
    missing = sorted(k for k, (path, _) in table.items() if path not in out)
    if missing:
        raise ValueError(f"EAGLE-3 head {model_dir} is missing tensors: {missing}")
    if not cfg.has_d2t:  # one vocabulary: draft id == target id
        out[("d2t",)] = jax.device_put(np.arange(cfg.padded_draft_vocab, dtype=np.int32), _get(placements, ("d2t",)))
    layer = specs.layer.replace(**{f: out[("layer", f)] if ("layer", f) in out else None
                                   for f in specs.layer.__dataclass_fields__})
    weights = eagle3.Eagle3Weights(fc=out[("fc",)], hidden_norm=out[("hidden_norm",)], layer=layer,
                                   final_norm=out[("final_norm",)], lm_head=out[("lm_head",)], d2t=out[("d2t",)],
                                   embed=out.get(("embed",)))
    return cfg, weights


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = getattr(tree, key)
    return tree
