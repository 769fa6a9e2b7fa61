"""The TPU (Mosaic) kernel compiles for v5e, v6e and v5p at serving shapes, on a CPU-only machine.

libtpu compiles against compile-only topologies (`jax.experimental.topologies`): no TPU is
attached, nothing runs. Each compile also checks, from the compiled HLO, that
  * the kernel got the scoped VMEM budget of its target (so the target was recognised),
  * the VMEM the compiled kernel holds stays within `vmem_bytes(...)` (the bound block sizes are
    chosen by), and
  * XLA does not relayout (copy) the KV cache to feed the kernel.
The matrix is a covering design: every value of every dimension appears at least once per target.
"""
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rpa_cases import assert_close, fresh_rng, make_case

from jaxserve.planning.targets import parse_target
from kernels_pallas.ragged_paged_attention_reference import (
    ragged_paged_attention_reference,
)

# kernels_pallas/__init__ re-exports the function under the module's name: import the module.
rpa = importlib.import_module("kernels_pallas.ragged_paged_attention_tpu")

# target -> the compile-only slice it is compiled on (jaxserve/planning/targets.py; v5p is megacore: one
# device = two TensorCores). libtpu is in the test extra: a missing one fails, it never skips.
_TARGET_NAMES = {"v5e": "tpu-v5e:2x2", "v6e": "tpu-v6e:1x1", "v5p": "tpu-v5p:2x2x1"}
TARGETS = tuple(_TARGET_NAMES)


@functools.cache
def _device(target):
    return parse_target(_TARGET_NAMES[target]).devices()[0]


def _replicated(target):
    return NamedSharding(Mesh(np.array([_device(target)]), ("x",)), PartitionSpec())


def _args(target, *, head_dim, kv_heads, group, page_size, dtype, tokens, max_seqs, context,
          num_pages=2048):
    rep = _replicated(target)

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    max_pages = context // page_size
    page = (num_pages, page_size, kv_heads, head_dim)
    return (
        spec((tokens, kv_heads * group, head_dim), dtype), spec(page, dtype), spec(page, dtype),
        spec((max_seqs,), jnp.int32), spec((max_seqs + 1,), jnp.int32),
        spec((max_seqs, max_pages), jnp.int32), spec((1,), jnp.int32),
    )


def _compile(args, **kw):
    fn = jax.jit(lambda *a: rpa.ragged_paged_attention_tpu(*a, sm_scale=0.125, **kw))
    return fn.lower(*args).compile()


def _kernel_vmem(hlo: str) -> tuple[int, int]:
    """(scoped VMEM limit the kernel got, VMEM the compiled kernel holds), from the custom call."""
    line = next(
        l for l in hlo.splitlines()
        if 'custom_call_target="tpu_custom_call"' in l and "ragged_paged_attention_tpu" in l
    )
    config = r'scoped_memory_configs":\[\{"memory_space":"1","offset":"(\d+)","size":"(\d+)"'
    scoped = re.search(r'"' + config, line)
    used = re.search(r'"used_' + config, line)
    assert scoped and used, f"no scoped VMEM configs on the kernel's custom call: {line[:300]}"
    offset, limit = int(scoped.group(1)), int(scoped.group(2))
    # `used` counts from the start of scoped VMEM; the kernel's region begins at `offset`.
    return limit, int(used.group(1)) + int(used.group(2)) - offset


def _kv_cache_copies(hlo: str, args) -> list[str]:
    """Instructions that copy / relayout a whole K or V cache."""
    k = args[1]
    short = {"bfloat16": "bf16", "float32": "f32", "int8": "s8", "float8_e4m3fn": "f8e4m3fn",
             "float8_e5m2": "f8e5m2"}[jnp.dtype(k.dtype).name]
    shapes = {f"{short}[{','.join(map(str, k.shape))}]",
              f"{short}[{k.shape[0]},{k.shape[1]},{k.shape[3]}]"}
    pattern = re.compile(r"= (\S+?)\{[^}]*\} (copy|copy-start|fusion)\(")
    return [l.strip()[:160] for l in hlo.splitlines()
            if (m := pattern.search(l)) and m.group(1) in shapes]


# --- the compile matrix ----------------------------------------------------------------------
# Each case is a real model's attention (per device) in one step bucket. Coverage per target:
#   head_dim 64 (C, G) 128 (A, B, H, I) 256 (D, E, F); kv heads 1 (B) 2 (C, I) 4 (E, G)
#   8 (A, D) 16 (F, H); group 1 (E, F) 2 (D, G, H) 4 (A) 6 (I) 7 (C) 8 (B); page size 16 (A, D, I)
#   32 (B, H) 64 (C, F) 128 (E, G); sliding window (C, D, G); soft cap (D, E, G); f32 (C, E, H)
#   bf16 (A, B, D, F, G, I); tokens 16 (B, G) 256 (C, H) 1024 (E, F) 2048 (D, I) 8192 (A);
#   max seqs 4 (E) 16 (B) 32 (F) 64 (C, I) 128 (D, H) 256 (A, G); context 8k (A, D, H)
#   16k (C) 32k (B, E, F, G, I).
CASES = {
    "A-llama3-8b-prefill": dict(head_dim=128, kv_heads=8, group=4, page_size=16,
                                dtype=jnp.bfloat16, tokens=8192, max_seqs=256, context=8192),
    "B-llama3-70b-tp8-decode": dict(head_dim=128, kv_heads=1, group=8, page_size=32,
                                   dtype=jnp.bfloat16, tokens=16, max_seqs=16, context=32768),
    "C-qwen-0.5b-f32-window": dict(head_dim=64, kv_heads=2, group=7, page_size=64,
                                   dtype=jnp.float32, tokens=256, max_seqs=64, context=16384,
                                   sliding_window=4096),
    "D-gemma2-9b-window-softcap": dict(head_dim=256, kv_heads=8, group=2, page_size=16,
                                       dtype=jnp.bfloat16, tokens=2048, max_seqs=128,
                                       context=8192, sliding_window=4096, soft_cap=50.0),
    "E-mha-f32-softcap": dict(head_dim=256, kv_heads=4, group=1, page_size=128,
                              dtype=jnp.float32, tokens=1024, max_seqs=4, context=32768,
                              soft_cap=30.0),
    "F-gemma-7b-mha": dict(head_dim=256, kv_heads=16, group=1, page_size=64, dtype=jnp.bfloat16,
                           tokens=1024, max_seqs=32, context=32768),
    "G-small-window-softcap": dict(head_dim=64, kv_heads=4, group=2, page_size=128,
                                   dtype=jnp.bfloat16, tokens=16, max_seqs=256, context=32768,
                                   sliding_window=1024, soft_cap=30.0),
    "H-gemma2-27b-f32": dict(head_dim=128, kv_heads=16, group=2, page_size=32, dtype=jnp.float32,
                             tokens=256, max_seqs=128, context=8192),
    "I-qwen-1.5b-32k": dict(head_dim=128, kv_heads=2, group=6, page_size=16, dtype=jnp.bfloat16,
                            tokens=2048, max_seqs=64, context=32768),
}
_SHAPE_KEYS = (
    "head_dim", "kv_heads", "group", "page_size", "dtype", "tokens", "max_seqs", "context",
)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target", TARGETS)
def test_kernel_compiles_within_vmem_budget(target, case):
    cfg = CASES[case]
    args = _args(target, **{k: cfg[k] for k in _SHAPE_KEYS})
    kw = {k: cfg[k] for k in ("sliding_window", "soft_cap") if k in cfg}
    hlo = _compile(args, **kw).as_text()

    limit, used = _kernel_vmem(hlo)
    assert limit == rpa.VMEM_BUDGET_BYTES[target], "target not recognised from the arguments"
    bq, npb = rpa.choose_blocks(
        head_dim=cfg["head_dim"], num_kv_heads=cfg["kv_heads"], group=cfg["group"],
        page_size=cfg["page_size"], max_pages_per_seq=cfg["context"] // cfg["page_size"],
        dtype=cfg["dtype"], budget=limit,
    )
    bound = rpa.vmem_bytes(
        head_dim=cfg["head_dim"], num_kv_heads=cfg["kv_heads"], group=cfg["group"],
        page_size=cfg["page_size"], block_q=bq, pages_per_block=npb, dtype=cfg["dtype"],
    )
    assert 0 < used <= bound <= limit, (used, bound, limit, bq, npb)
    if cfg["head_dim"] >= 128:  # head_dim 64: see test_a_head_dim_64_cache_is_relaid_out_so_the_pool_is_lane_dense
        assert not _kv_cache_copies(hlo, args)


# 8-bit pages with per-token scales (kernels_pallas/kv_quant.py): bf16 and f32 queries, one and
# several pages per kv block (multi-page blocks build their scale rows with the one-hot matmul).
# A Latin square: every page dtype meets every target and every case once.
QUANTIZED_CASES = ("A-llama3-8b-prefill", "B-llama3-70b-tp8-decode", "C-qwen-0.5b-f32-window")
PAGE_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
QUANTIZED_MATRIX = [(t, QUANTIZED_CASES[(i + j) % 3], d) for i, t in enumerate(TARGETS)
                    for j, d in enumerate(PAGE_DTYPES)]


@pytest.mark.parametrize("target,case,page_dtype", QUANTIZED_MATRIX,
                         ids=[f"{t}-{c[0]}-{jnp.dtype(d).name}" for t, c, d in QUANTIZED_MATRIX])
def test_quantized_pages_compile_within_vmem_budget(target, case, page_dtype):
    cfg = CASES[case]
    q, k, v, *meta = _args(target, **{k: cfg[k] for k in _SHAPE_KEYS})
    rep = _replicated(target)
    k = v = jax.ShapeDtypeStruct(k.shape, page_dtype, sharding=rep)
    num_pages, page_size, kv_heads, _ = k.shape
    scales = jax.ShapeDtypeStruct((num_pages, kv_heads, page_size), jnp.float32, sharding=rep)
    kw = {k: cfg[k] for k in ("sliding_window", "soft_cap") if k in cfg}
    fn = jax.jit(lambda q, k, v, *m: rpa.ragged_paged_attention_tpu(
        q, k, v, *m[:4], sm_scale=0.125, k_scales=m[4], v_scales=m[5], **kw))
    hlo = fn.lower(q, k, v, *meta, scales, scales).compile().as_text()
    limit, used = _kernel_vmem(hlo)
    assert limit == rpa.VMEM_BUDGET_BYTES[target]
    sizes = dict(head_dim=cfg["head_dim"], num_kv_heads=cfg["kv_heads"], group=cfg["group"],
                 page_size=cfg["page_size"], dtype=cfg["dtype"], page_dtype=page_dtype)
    bq, npb = rpa.choose_blocks(**sizes, max_pages_per_seq=cfg["context"] // cfg["page_size"], budget=limit)
    bound = rpa.vmem_bytes(**sizes, block_q=bq, pages_per_block=npb)
    assert 0 < used <= bound <= limit, (used, bound, limit, bq, npb)
    if cfg["head_dim"] >= 128:  # head_dim 64: see test_a_head_dim_64_cache_is_relaid_out_so_the_pool_is_lane_dense
        assert not _kv_cache_copies(hlo, (q, k, v))


@pytest.mark.parametrize("target", TARGETS)
def test_single_kv_head_cache_is_not_relaid_out(target):
    # TP with one kv head per chip: bf16 goes through the [P, ps, D] path, f32 keeps 4-D.
    for dtype in (jnp.bfloat16, jnp.float32):
        args = _args(target, head_dim=256, kv_heads=1, group=8, page_size=16, dtype=dtype,
                     tokens=64, max_seqs=8, context=8192)
        hlo = _compile(args).as_text()
        assert not _kv_cache_copies(hlo, args), jnp.dtype(dtype).name


def test_a_head_dim_64_cache_is_relaid_out_so_the_pool_is_lane_dense():
    """XLA's default TPU layout of a [P, ps, KVH, 64] cache puts the page axis minor, so feeding the
    row-major kernel operand copies the whole cache each call. The serving pool therefore keeps a
    64-wide head's K and V side by side in 128 lanes on a TPU (kv_groups.fused_kv; model/paged.py
    gives that array as both K and V and pads q): a 128-lane cache is fed where it lies."""
    shape = dict(kv_heads=8, group=4, page_size=16, dtype=jnp.bfloat16, tokens=64, max_seqs=8, context=8192)
    narrow = _args("v6e", head_dim=64, **shape)
    assert _kv_cache_copies(_compile(narrow).as_text(), narrow)
    lane_dense = _args("v6e", head_dim=128, **shape)
    assert not _kv_cache_copies(_compile(lane_dense).as_text(), lane_dense)


# --- errors the wrapper raises before Mosaic does --------------------------------------------

def test_explicit_block_too_large_for_vmem_names_the_parameters():
    args = _args("v5p", head_dim=256, kv_heads=16, group=8, page_size=128, dtype=jnp.float32,
                 tokens=1024, max_seqs=16, context=8192)
    with pytest.raises(ValueError) as err:
        jax.jit(lambda *a: rpa.ragged_paged_attention_tpu(
            *a, sm_scale=0.1, block_q=64, pages_per_block=4)).lower(*args)
    msg = str(err.value)
    need = rpa.vmem_bytes(head_dim=256, num_kv_heads=16, group=8, page_size=128, block_q=64,
                          pages_per_block=4, dtype=jnp.float32)
    for part in ("head_dim=256", "num_kv_heads=16", "group=8", "page_size=128", "block_q=64",
                 "pages_per_block=4", "dtype=float32", f"need {need} bytes",
                 f"target v5p is {32 << 20} bytes"):
        assert part in msg, (part, msg)


def test_default_blocks_shrink_to_fit_and_fail_when_nothing_fits():
    kw = dict(head_dim=256, num_kv_heads=16, group=8, max_pages_per_seq=256, dtype=jnp.float32)
    sizes = dict(head_dim=256, num_kv_heads=16, group=8, dtype=jnp.float32)
    # Defaults when they fit: ~128 q rows, ~128 keys.
    assert rpa.choose_blocks(**kw, page_size=16, budget=1 << 40) == (16, 8)
    assert rpa.choose_blocks(**kw, page_size=128, budget=1 << 40) == (16, 1)
    # Over budget: block_q halves first (keeping whole 16-row tiles), then pages_per_block.
    assert rpa.choose_blocks(**kw, page_size=16, budget=24 << 20) == (8, 8)
    assert rpa.choose_blocks(**kw, page_size=16, budget=8 << 20) == (2, 2)
    assert rpa.vmem_bytes(**sizes, page_size=16, block_q=2, pages_per_block=2) <= 8 << 20
    assert rpa.vmem_bytes(**sizes, page_size=16, block_q=2, pages_per_block=4) > 8 << 20
    # A caller's size is kept as given; only the other one shrinks.
    assert rpa.choose_blocks(**kw, page_size=16, budget=32 << 20, block_q=16) == (16, 4)
    # Nothing fits: the smallest blocks tried are named.
    with pytest.raises(ValueError, match=r"group=8, page_size=128, block_q=2, pages_per_block=1, "
                                         r"dtype=float32 need \d+ bytes of VMEM but the budget "
                                         r"for target unknown is 4194304 bytes"):
        rpa.choose_blocks(**kw, page_size=128, budget=4 << 20)


def test_page_tables_too_large_for_smem_raise_before_compiling():
    # 256 rows x 32k context in 16-token pages: a 2 MiB table cannot be scalar-prefetched (SMEM
    # holds 1 MiB; XLA would fail with "Ran out of memory in memory space smem").
    args = _args("v6e", head_dim=128, kv_heads=8, group=4, page_size=16, dtype=jnp.bfloat16,
                 tokens=256, max_seqs=256, context=32768)
    with pytest.raises(ValueError, match=r"max_seqs=256 x max_pages_per_seq=2048 \(page_size=16\)"):
        jax.jit(lambda *a: rpa.ragged_paged_attention_tpu(*a, sm_scale=0.1)).lower(*args)


def test_target_and_budget_follow_the_arguments_devices():
    for target in TARGETS:
        q = jax.ShapeDtypeStruct((8, 4, 128), jnp.float32, sharding=_replicated(target))
        seen = []
        jax.jit(lambda x: seen.append(rpa.tpu_target(x)) or x).lower(q)
        assert seen == [target]
        assert rpa.vmem_budget_bytes(target) == rpa.VMEM_BUDGET_BYTES[target]
    assert rpa.tpu_target(jnp.zeros(3)) is None  # CPU array, CPU default device
    assert rpa.vmem_budget_bytes(None) == rpa.FALLBACK_VMEM_BUDGET_BYTES


# --- the single-head [P, ps, D] path computes the same numbers (TPU interpreter) -------------

def test_single_bf16_kv_head_path_matches_reference():
    rng = fresh_rng()
    case = make_case(rng, [(1, 7), (5, 12), (3, 10)], num_q_heads=4, num_kv_heads=1, head_dim=16,
                     page_size=4, max_seqs=4, extra_rows=2, poison=True)
    args = case.args(jnp.bfloat16)
    out = rpa.ragged_paged_attention_tpu(*args, sm_scale=case.sm_scale, block_q=4,
                                         pages_per_block=1, interpret=True)
    ref = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale)
    live = case.num_live_rows
    assert_close(out[:live], np.asarray(ref.astype(jnp.float32))[:live], rtol=1e-2)
