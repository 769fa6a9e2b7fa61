"""The ragged paged forward: one flat batch of new tokens attending over the donated KV pages.

Each layer writes its new K/V into the pool at its slots and then runs ragged paged attention
over the sequences' page tables (its layer group's: core/kv_groups.py). Logits are computed only
for `logits_index` rows.
A token row with `prev_sample_row >= 0` takes its id from `prev_ids` (the previous step's sampled
ids, still on the device): async scheduling plans a decode before its token reaches the host.
A hybrid stack's linear-attention layers read and write their sequences' recurrent-state slots
instead (`PagedMixer`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.model import kv_cache
from jaxserve.model.state_cache import LinearState
from kernels_pallas.gated_delta_reference import ragged_causal_conv1d, ragged_gated_delta
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


class PagedMixer:
    """The linear layers over the ragged step: sequence row s runs its q_len tokens from the state
    in its slot (`arrays.state_slot[s]`), or from zero when its chunk starts at position 0, and
    leaves its state there. `states` (one LinearState per linear layer) is updated as the layers
    are traced. Rows without tokens (padding) read nothing that matters and write nothing."""

    def __init__(self, cfg: ModelConfig, arrays: Any, states: list[LinearState]) -> None:
        self.cfg, self.states = cfg, states
        self.layer_state = {layer: j for j, layer in enumerate(cfg.linear_layers)}
        cu = arrays.cu_q_lens
        self.starts, self.lens = cu[:-1], cu[1:] - cu[:-1]                      # [S]
        first = arrays.positions[jnp.clip(self.starts, 0, arrays.positions.shape[0] - 1)]
        self.fresh = first == 0                                                 # [S] starts from zero
        num_slots = states[0].delta.shape[0]
        self.read_slot = arrays.state_slot
        # each row's end state to its own slot and, at a page boundary, to a prefix-cache snapshot
        # (engine/state_slots.py); out of bounds (padding, no snapshot): dropped
        self.write_slot = jnp.where(self.lens > 0, arrays.state_slot, num_slots)
        self.snapshot_slot = jnp.where(self.lens > 0, arrays.state_snapshot, num_slots)

    def _read(self, slots: jax.Array) -> jax.Array:
        """[N, ...] -> each row's starting state [S, ...] (zeros where fresh or padding)."""
        got = jnp.take(slots, self.read_slot, axis=0, mode="fill", fill_value=0)
        return jnp.where(self.fresh.reshape((-1,) + (1,) * (got.ndim - 1)), jnp.zeros_like(got), got)

    def _write(self, slots: jax.Array, new: jax.Array) -> jax.Array:
        new = new.astype(slots.dtype)  # two scatters of [S] rows: no [2S] copy of the new states
        return slots.at[self.write_slot].set(new, mode="drop").at[self.snapshot_slot].set(new, mode="drop")

    def conv(self, i: int, x: jax.Array, weight: jax.Array) -> jax.Array:
        j = self.layer_state[i]
        st = self.states[j]
        y, new = ragged_causal_conv1d(x, self._read(st.conv).astype(x.dtype), self.starts, self.lens, weight)
        self.states[j] = st._replace(conv=self._write(st.conv, new))
        return y

    def delta(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array) -> jax.Array:
        j = self.layer_state[i]
        st = self.states[j]
        out, new = ragged_gated_delta(q, k, v, g, beta, self._read(st.delta), self.starts, self.lens)
        self.states[j] = st._replace(delta=self._write(st.delta, new))
        return out


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
    mixer = PagedMixer(cfg, arrays, list(kv.states)) if cfg.linear_layers else None
    out = forward(weights, cfg, token_ids, arrays.positions, attend, [None] * cfg.num_layers,
                  logits_index=arrays.logits_index, seq_lens_per_token=seq_len_per_token, lora=lora_inputs,
                  aux_layers=aux_layers, moe_fn=moe_fn, mixer=mixer)
    pages = kv_cache.KVPages.from_layers(pool)
    if mixer is not None:
        pages = pages.replace(states=mixer.states)
    return (out[0], pages, *out[2:])
