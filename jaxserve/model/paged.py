"""The ragged paged forward: one flat batch of new tokens attending over the donated KV pages.

Each layer writes its new K/V into the pool at its slots and then runs ragged paged attention
over the sequences' page tables (its layer group's: core/kv_groups.py). Logits are computed only
for `logits_index` rows.
A token row with `prev_sample_row >= 0` takes its id from `prev_ids` (the previous step's sampled
ids, still on the device): async scheduling plans a decode before its token reaches the host.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.model import kv_cache
from jaxserve.core.config import ModelConfig
from jaxserve.model.lora import LoraInputs
from jaxserve.model.transformer import forward
from jaxserve.model.weights import Weights


def resolve_token_ids(arrays: Any, prev_ids: jax.Array) -> jax.Array:
    """[T] the step's token ids, in-flight ones (prev_sample_row >= 0) read from `prev_ids`."""
    pending = arrays.prev_sample_row >= 0
    return jnp.where(pending, prev_ids[jnp.where(pending, arrays.prev_sample_row, 0)], arrays.token_ids)


def group_tables(cfg: ModelConfig, arrays: Any, page_size: int, pad_slot: int) -> list[tuple[jax.Array, jax.Array]]:
    """Per KV layer group (core/kv_groups.py): (its page tables [S, M], its tokens' slots [T]).
    The step's `page_tables` is [S, G * M], group g in columns [g M, (g + 1) M); group 0's slots
    come from the host, the others' are found here from their tables (padding stays padding)."""
    groups = cfg.kv_groups.num_groups
    if groups == 1:
        return [(arrays.page_tables, arrays.slot_mapping)]
    width = arrays.page_tables.shape[1] // groups
    pos = arrays.positions
    out = []
    for g in range(groups):
        tables = arrays.page_tables[:, g * width:(g + 1) * width]
        if g == 0:
            slots = arrays.slot_mapping
        else:
            page = tables[arrays.token_seq, jnp.minimum(pos // page_size, width - 1)]
            slots = jnp.where(arrays.slot_mapping == pad_slot, pad_slot, page * page_size + pos % page_size)
        out.append((tables, slots))
    return out


def paged_attend(cfg: ModelConfig, arrays: Any, attention_fn: Callable[..., jax.Array],
                 pool: list[kv_cache.LayerKV]) -> Any:
    """The `attend` of transformer.forward over the paged pool: layer i writes the step's K/V into
    its pool array (kv_groups.layer_array) at its group's slots, then runs ragged paged attention
    over its group's page tables. `pool` (one LayerKV per pool array) is updated in place as the
    layers are traced: layers of different groups share arrays."""
    groups = cfg.kv_groups
    ps = pool[0].k.shape[1]
    tables = group_tables(cfg, arrays, ps, pool[0].k.shape[0] * ps)

    def attend(i, q, k, v, _cache, sinks=None):
        a = groups.layer_array[i]
        page_tables, slot_mapping = tables[groups.layer_group[i]]
        latent = cfg.mla is not None  # k is the latent row, and attention reads it as V too
        layer_kv = kv_cache.write(pool[a], k, None if latent else v, slot_mapping)
        pool[a] = layer_kv
        # a TPU pool's heads may be wider than q's (kv_groups.pool_head_dim: zero lanes) or hold K
        # and V side by side (fused_kv): q, zero in the rest, reads only K; the output's lanes
        # that p @ v filled are the V lanes. A latent row is read once, as K and as its first
        # kv_lora_rank lanes of values (the kernels' v_pages=None).
        head_dim = q.shape[-1]
        lanes = slice(head_dim, 2 * head_dim) if layer_kv.fused and not latent else slice(0, head_dim)
        values = {"v_head_dim": cfg.mla.kv_lora_rank} if latent else {}
        out = attention_fn(kv_cache.pad_lanes(q, layer_kv.k.shape[-1]), layer_kv.k, None if latent else layer_kv.v,
                           arrays.seq_lens, arrays.cu_q_lens, page_tables, arrays.num_seqs, sm_scale=cfg.scale,
                           sliding_window=cfg.layer_windows[i], soft_cap=cfg.attn_soft_cap,
                           **({} if sinks is None else {"sinks": sinks.astype(jnp.float32)}),  # [Hq]
                           k_scales=layer_kv.k_scales, v_scales=None if latent else layer_kv.v_scales, **values)
        return out[..., lanes], None

    return attend


def forward_paged(weights: Weights, cfg: ModelConfig, kv: kv_cache.KVPages, arrays: Any,
                  attention_fn: Callable[..., jax.Array],
                  prev_ids: jax.Array, lora: Any = None, aux_layers: tuple[int, ...] = (),
                  moe_fn: Callable[..., jax.Array] | None = None) -> tuple[Any, ...]:
    """arrays: a StepArrays of device arrays; prev_ids: [max_num_seqs] int32, the previous step's
    sampled ids; lora: the adapter slots' factors per layer (lora/slots.py) when LoRA is on, read
    by each token through its `arrays.lora_slot`. Returns (logits [S, Vp] float32, updated pages), and
    with `aux_layers` the target hidden states an EAGLE-3 head reads ([T, 3 D]; transformer.forward)."""
    token_ids = resolve_token_ids(arrays, prev_ids)
    seq_len_per_token = arrays.seq_lens[arrays.token_seq]
    pool = kv.layers()
    attend = paged_attend(cfg, arrays, attention_fn, pool)
    lora_inputs = None
    if lora is not None:
        num_slots = next(iter(lora[0].values()))[1].shape[0]  # any module's b: [N, R, *out]
        one_hot = (arrays.lora_slot[:, None] == jnp.arange(num_slots)[None, :]).astype(jnp.float32)  # [T, N]
        lora_inputs = LoraInputs(lora, one_hot)
    out = forward(weights, cfg, token_ids, arrays.positions, attend, [None] * cfg.num_layers,
                  logits_index=arrays.logits_index, seq_lens_per_token=seq_len_per_token, lora=lora_inputs,
                  aux_layers=aux_layers, moe_fn=moe_fn)
    return (out[0], kv_cache.KVPages.from_layers(pool), *out[2:])
