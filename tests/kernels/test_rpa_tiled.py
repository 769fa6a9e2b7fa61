"""The tiled jnp path (CPU production) == the reference, for every tiling of the same inputs."""
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import (
    MIXED,
    SMALL,
    check_against_reference,
    fresh_rng,
    fresh_seed,
    make_case,
    scramble_padding,
)

from kernels_pallas.cpu_decode_attention import ragged_paged_attention_cpu
from kernels_pallas.ragged_paged_attention_tiled import default_block_q, ragged_paged_attention_tiled

PREFILL = [(37, 37), (20, 45), (9, 9)]       # long chunks: several tiles per sequence


def _check(case, *, fn=ragged_paged_attention_tiled, block_q=None, **kw):
    return check_against_reference(fn, case, block_q=block_q, **kw)


@pytest.mark.parametrize("block_q", [None, 1, 2, 4, 16])
@pytest.mark.parametrize("seqs,group", [(MIXED, 4), (PREFILL, 2)])
def test_tiled_matches_reference_for_every_tile_size(seqs, group, block_q):
    case = make_case(fresh_rng(), seqs, num_q_heads=2 * group, max_seqs=len(seqs) + 2, extra_rows=3, **SMALL)
    scramble_padding(case)
    _check(case, block_q=block_q)


def test_tiled_window_soft_cap_and_bf16():
    case = make_case(fresh_rng(), PREFILL, num_q_heads=8, max_seqs=4, **SMALL)
    case.q *= 4.0
    _check(case, block_q=8, sliding_window=6, soft_cap=2.0)
    _check(case, block_q=4, dtype=jnp.bfloat16, rtol=1e-2)


def test_tiled_ignores_nan_outside_live_slots():
    seed = fresh_seed()
    kw = dict(num_q_heads=4, max_seqs=4, extra_rows=2, **SMALL)
    clean = make_case(np.random.default_rng(seed), PREFILL, **kw)
    poisoned = make_case(np.random.default_rng(seed), PREFILL, poison=True, **kw)
    np.testing.assert_array_equal(_check(poisoned, block_q=8), _check(clean, block_q=8))


@pytest.mark.parametrize("fn", [ragged_paged_attention_tiled, ragged_paged_attention_cpu], ids=["jnp", "native"])
@pytest.mark.parametrize("window", [None, 5])
def test_many_decodes_of_ragged_contexts_in_several_blocks(window, fn):
    """More decodes than one block holds (64 rows), contexts of 1 to 300 tokens (1-3 KV chunks) in
    no order, a short and a tall prefill chunk between them (301 rows: 256-row tiles for the
    140-token chunk, 128-row ones for the 9-token chunk) and NaN in every dead slot: every row
    equals the reference (jnp decode blocks are sorted by context, each loops to its own longest;
    the native decode reads only each row's own context and window)."""
    rng = fresh_rng()
    seqs = [(1, int(n)) for n in rng.integers(1, 301, 150)]
    seqs.insert(70, (9, 30))
    seqs.insert(20, (140, 250))
    case = make_case(rng, seqs, num_q_heads=4, max_seqs=len(seqs) + 5, extra_rows=2, poison=True, **SMALL)
    _check(case, sliding_window=window, fn=fn)


def test_default_block_q_is_the_largest_power_of_two_up_to_256():
    assert default_block_q(64) == 64
    assert default_block_q(48) == 32
    assert default_block_q(8) == 8
    assert default_block_q(300) == 256
    assert default_block_q(4096) == 256
