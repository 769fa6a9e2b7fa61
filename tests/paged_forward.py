"""The serving forward (model/paged.py) over one sequence outside the engine: teacher-forced logits
through a KV pool of any `--kv-cache-dtype` (tests and scripts/bench_quant.py)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import kv_cache
from jaxserve.core.config import ModelConfig
from jaxserve.model.paged import forward_paged
from jaxserve.model.weights import Weights
from jaxserve.quant import kv as kv_quant
from jaxserve.parallel.sharding import make_mesh, Placement
from jaxserve.runner.step_inputs import StepArrays
from kernels_pallas import ragged_paged_attention_reference


def paged_logits(weights: Weights, cfg: ModelConfig, ids: Sequence[int], kv_cache_dtype: str,
                 page_size: int = 16) -> tuple[jax.Array, kv_cache.KVPages]:
    """(float32 logits [T, V] of every position, the pool after the step): one prefill chunk through
    forward_paged with the reference attention, its K/V written to and read back from a
    `kv_cache_dtype` pool (what every decode step of the engine does)."""
    t = len(ids)
    pages = -(-t // page_size)
    kv = kv_cache.allocate(cfg, pages, page_size, kv_quant.storage_dtype(kv_cache_dtype, jnp.float32), Placement(make_mesh(1, 1)))
    arange = np.arange(t, dtype=np.int32)
    arrays = StepArrays(token_ids=np.asarray(ids, np.int32), positions=arange, token_seq=np.zeros(t, np.int32),
                        slot_mapping=arange, cu_q_lens=np.array([0, t], np.int32), seq_lens=np.array([t], np.int32),
                        page_tables=np.arange(pages, dtype=np.int32)[None], num_seqs=np.array([1], np.int32),
                        logits_index=arange, prev_sample_row=np.full(t, -1, np.int32))
    arrays = StepArrays(*(None if a is None else jnp.asarray(a) for a in arrays))
    logits, kv = forward_paged(weights, cfg, kv, arrays, ragged_paged_attention_reference, jnp.zeros(1, jnp.int32))
    return logits[:, :cfg.vocab_size], kv
