"""Static (trace-time) argument checks shared by every ragged paged attention backend.

Only shapes, dtypes and the static keyword arguments can be checked inside `jax.jit`; the values
(page ids in range, `seq_lens[s] >= q_len[s]`, ...) are preconditions the caller guarantees.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kernels_pallas.kv_quant import SCALE_DTYPE, is_quantized


@dataclasses.dataclass(frozen=True)
class AttentionDims:
    """Sizes read off the arguments of `ragged_paged_attention`."""

    num_tokens: int  # T
    num_q_heads: int  # H
    head_dim: int  # D
    num_pages: int  # P
    page_size: int  # ps
    num_kv_heads: int  # KVH
    max_seqs: int  # S
    max_pages_per_seq: int  # MP
    v_head_dim: int  # Dv: the output's lanes (D, or the leading lanes of K's rows when v_pages is None)

    @property
    def group(self) -> int:
        """q heads per kv head (G)."""
        return self.num_q_heads // self.num_kv_heads


def _require_int32(name: str, x, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_attention_args(
    q,
    k_pages,
    v_pages,
    seq_lens,
    cu_q_lens,
    page_tables,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scales=None,
    v_scales=None,
    sinks=None,
    v_head_dim: int | None = None,
) -> AttentionDims:
    """Raises ValueError naming the first bad argument; returns the sizes.

    `v_pages` None: every key row is also its value, read once (multi-head latent attention's latent
    row); the values are its first `v_head_dim` lanes (default all), the V scales are K's."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            "k_pages must be [num_pages, page_size, num_kv_heads, head_dim], "
            f"got shape {k_pages.shape}"
        )
    shared = v_pages is None
    if shared:
        if v_scales is not None:
            raise ValueError("v_scales must be None when v_pages is None (the values are the keys' rows, "
                             "scaled by k_scales)")
        v_pages, v_scales = k_pages, k_scales
    elif v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages shape {k_pages.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a floating dtype, got {q.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, head_dim_kv = k_pages.shape
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} differs from k_pages dtype {k_pages.dtype}")
    if is_quantized(k_pages.dtype):
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is None:
                raise ValueError(f"{k_pages.dtype} (quantized) pages need {name} [num_pages, num_kv_heads, "
                                 f"page_size] float32")
            if tuple(scales.shape) != (num_pages, num_kv_heads, page_size) or scales.dtype != SCALE_DTYPE:
                raise ValueError(f"{name} must be float32 {(num_pages, num_kv_heads, page_size)}, got "
                                 f"{scales.dtype} {tuple(scales.shape)}")
    else:
        if k_pages.dtype != q.dtype:
            raise ValueError(f"k_pages dtype {k_pages.dtype} differs from q dtype {q.dtype}")
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_scales / v_scales are only for quantized pages, not {k_pages.dtype}")
    if num_tokens < 1:
        raise ValueError("q must hold at least one token row")
    if head_dim_kv != head_dim:
        raise ValueError(f"k_pages head_dim {head_dim_kv} differs from q head_dim {head_dim}")
    if v_head_dim is not None and (not shared or not isinstance(v_head_dim, int) or isinstance(v_head_dim, bool)
                                   or not 1 <= v_head_dim <= head_dim):
        raise ValueError(f"v_head_dim must be None, or with v_pages None an int in [1, {head_dim}]; got "
                         f"{v_head_dim!r}" + ("" if shared else " with separate v_pages"))
    if num_pages < 1 or page_size < 1 or num_kv_heads < 1:
        raise ValueError(f"k_pages has an empty dimension: shape {k_pages.shape}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if page_tables.ndim != 2:
        raise ValueError(f"page_tables must be [S, max_pages_per_seq], got shape {page_tables.shape}")
    max_seqs, max_pages = page_tables.shape
    if max_seqs < 1 or max_pages < 1:
        raise ValueError(f"page_tables has an empty dimension: shape {page_tables.shape}")
    _require_int32("page_tables", page_tables, (max_seqs, max_pages))
    _require_int32("seq_lens", seq_lens, (max_seqs,))
    _require_int32("cu_q_lens", cu_q_lens, (max_seqs + 1,))
    _require_int32("num_seqs", num_seqs, (1,))
    if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite Python float, got {sm_scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if soft_cap is not None and (
        not isinstance(soft_cap, (int, float)) or not math.isfinite(soft_cap) or soft_cap <= 0
    ):
        raise ValueError(f"soft_cap must be None or a positive finite float, got {soft_cap!r}")
    if sinks is not None:
        if tuple(getattr(sinks, "shape", ())) != (num_q_heads,) or getattr(sinks, "dtype", None) != jnp.float32:
            raise ValueError(f"sinks must be None or float32 [num_q_heads] = ({num_q_heads},), got "
                             f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}")
    return AttentionDims(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        max_seqs=max_seqs,
        max_pages_per_seq=max_pages,
        v_head_dim=v_head_dim or head_dim,
    )


def check_block_arg(name: str, value: int | None) -> None:
    """Tuning knobs are positive ints (or None for the default)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be None or a positive int, got {value!r}")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# A finite "minus infinity": masked logits use it so that max/exp never see inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# KV positions one step of the jnp paths' chunk loop covers (small: the dynamic trip count then
# stops close to the longest live sequence).
CHUNK_TOKENS = 128
