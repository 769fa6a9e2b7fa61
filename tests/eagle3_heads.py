"""Tiny EAGLE-3 heads in the Hugging Face layout the EAGLE authors publish (config.json with
`LlamaForCausalLMEagle3`, safetensors named `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`),
and a PyTorch oracle of the head's greedy proposals built from transformers' Llama pieces over the
target's own `output_hidden_states` (the convention vLLM serves: the residual stream entering each
chosen layer, concatenated in layer order; the head's row for position p reads the token at p + 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.llama import modeling_llama as ml


def head_config(target: Any, draft_vocab: int | None = None, aux_layers: list[int] | None = None,
                embed: bool = False, **extra: Any) -> dict[str, Any]:
    t = target.config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": t.hidden_size, "intermediate_size": 80, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": t.max_position_embeddings,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": t.vocab_size, "tie_word_embeddings": False,
           "draft_vocab_size": draft_vocab or t.vocab_size, "torch_dtype": "float32"}
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    return {**cfg, **extra, "_embed": embed}


def write_head(directory: Path, config: dict[str, Any], seed: int = 0, prefix: str = "midlayer.",
               scale: float = 0.2, targets: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Random head weights saved as the EAGLE authors name them (layer tensors under `prefix`);
    returns the tensors (torch). targets: the target id of each draft id (a draft vocabulary)."""
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    g = torch.Generator().manual_seed(seed)
    d, f, hq, hkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, vd, v = cfg.get("head_dim") or d // hq, cfg["draft_vocab_size"], cfg["vocab_size"]

    def rnd(*shape: int, s: float = scale) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    t = {"fc.weight": rnd(d, 3 * d), "norm.weight": 1 + rnd(d, s=0.1), "lm_head.weight": rnd(vd, d),
         f"{prefix}hidden_norm.weight": 1 + rnd(d, s=0.1), f"{prefix}input_layernorm.weight": 1 + rnd(d, s=0.1),
         f"{prefix}post_attention_layernorm.weight": 1 + rnd(d, s=0.1),
         f"{prefix}self_attn.q_proj.weight": rnd(hq * hd, 2 * d), f"{prefix}self_attn.k_proj.weight": rnd(hkv * hd, 2 * d),
         f"{prefix}self_attn.v_proj.weight": rnd(hkv * hd, 2 * d), f"{prefix}self_attn.o_proj.weight": rnd(d, hq * hd),
         f"{prefix}mlp.gate_proj.weight": rnd(f, d), f"{prefix}mlp.up_proj.weight": rnd(f, d),
         f"{prefix}mlp.down_proj.weight": rnd(d, f)}
    if vd < v:  # a draft vocabulary: every draft id maps to a distinct target id
        targets = torch.tensor(targets) if targets is not None else torch.sort(torch.randperm(v, generator=g)[:vd]).values
        t["d2t"] = targets - torch.arange(vd)
        t["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, targets, True)
    if config.get("_embed"):
        t["embed_tokens.weight"] = rnd(v, d, s=1.0)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file({k: x.contiguous() for k, x in t.items()}, str(directory / "model.safetensors"))
    return {k.replace(prefix, "midlayer."): x for k, x in t.items()}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    norm = ml.LlamaRMSNorm(x.shape[-1], eps=eps)
    norm.weight.data = w
    return norm(x)


def reference_drafts(target: Any, head: dict[str, torch.Tensor], config: dict[str, Any], token_ids: list[int],
                     k: int) -> list[int]:
    """The head's k greedy drafts after `token_ids` (a prompt and the first token the target sampled
    after it), recomputed from scratch (no cache): rows 0..L-2 read the target's states at their
    position and the next token; each draft row reads the head's previous pre-norm output."""
    cfg = {k_: v for k_, v in config.items() if not k_.startswith("_")}
    lc = transformers.LlamaConfig(**{k_: v for k_, v in cfg.items() if k_ not in ("architectures", "eagle_config",
                                                                                   "draft_vocab_size")})
    eps, d = lc.rms_norm_eps, lc.hidden_size
    n_layers = target.config.num_hidden_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n_layers // 2, n_layers - 3]
    with torch.no_grad():
        out = target(torch.tensor([token_ids[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in sorted(set(ids))], dim=-1)         # [L-1, 3D]
        hidden = aux @ head["fc.weight"].T
        tokens = list(token_ids[1:])
        embed = head.get("embed_tokens.weight", target.model.embed_tokens.weight)
        mlp = ml.LlamaMLP(lc)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.data = head[f"midlayer.mlp.{name}.weight"]
        rotary = ml.LlamaRotaryEmbedding(lc)
        hq, hkv = lc.num_attention_heads, lc.num_key_value_heads
        hd = cfg.get("head_dim") or d // hq
        d2t = head.get("d2t")
        drafts = []
        for _ in range(k):
            n = len(tokens)
            e = _rms(embed[torch.tensor(tokens)], head["midlayer.input_layernorm.weight"], eps)
            hn = _rms(hidden, head["midlayer.hidden_norm.weight"], eps)
            x = torch.cat([e, hn], dim=-1)[None]                                            # [1, n, 2D]
            q = (x @ head["midlayer.self_attn.q_proj.weight"].T).view(1, n, hq, hd).transpose(1, 2)
            kk = (x @ head["midlayer.self_attn.k_proj.weight"].T).view(1, n, hkv, hd).transpose(1, 2)
            vv = (x @ head["midlayer.self_attn.v_proj.weight"].T).view(1, n, hkv, hd).transpose(1, 2)
            cos, sin = rotary(x, torch.arange(n)[None])
            q, kk = ml.apply_rotary_pos_emb(q, kk, cos, sin)
            kk, vv = ml.repeat_kv(kk, hq // hkv), ml.repeat_kv(vv, hq // hkv)
            scores = (q @ kk.transpose(-1, -2)) * hd ** -0.5
            scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            attn = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(1, n, hq * hd)
            residual = hn if cfg.get("norm_before_residual") else hidden
            h = residual[None] + attn @ head["midlayer.self_attn.o_proj.weight"].T
            h = h + mlp(_rms(h, head["midlayer.post_attention_layernorm.weight"], eps))
            last = h[0, -1]
            best = int(torch.argmax(_rms(last, head["norm.weight"], eps) @ head["lm_head.weight"].T))
            draft = best + int(d2t[best]) if d2t is not None else best
            drafts.append(draft)
            tokens.append(draft)
            hidden = torch.cat([hidden, last[None]], dim=0)
    return drafts
