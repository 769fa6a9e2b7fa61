"""Values read from the keys' rows (`v_pages=None`, `v_head_dim`): multi-head latent attention's one
latent row per token, read once as K and, its first kv_lora_rank lanes, as V.

Every backend against a numpy oracle whose V is K's leading lanes (interpreters for the TPU and GPU
kernels), at tiny shapes whose rows split into two lane parts on the GPU (32 + 16, as 512 + 64 does);
then both kernels compiled for their targets (v5e, v6e, v5p; H100, H200) at DeepSeek-V3's shapes (128 heads over 1 or 8 devices,
a latent row of 512 + 64, pages of 16-128 tokens, bf16 and fp8 latents), reading the latent pages
as one operand.
"""
from __future__ import annotations

import copy
import functools
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from rpa_cases import MIXED, assert_close, fresh_rng, make_case, numpy_oracle, scramble_padding
from test_rpa_gpu_compile import _kernel_report
from test_rpa_tpu_compile import _args as tpu_args
from test_rpa_tpu_compile import _kernel_vmem, _kv_cache_copies, _replicated

from jaxserve.planning import gpu_target
from kernels_pallas import get_attention_backend
from kernels_pallas.kv_quant import quantize
from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference

# kernels_pallas/__init__ re-exports the functions under their modules' names: import the modules.
tpu = importlib.import_module("kernels_pallas.ragged_paged_attention_tpu")
gpu = importlib.import_module("kernels_pallas.ragged_paged_attention_gpu")
blocks = importlib.import_module("kernels_pallas.gpu_blocks")

LATENT, ROPE = 32, 16  # tiny kv_lora_rank and rope dims: a 48-lane row, values its first 32 lanes
BACKENDS = {
    "reference": get_attention_backend("reference"),
    "tiled": get_attention_backend("tiled"),
    "cpu": get_attention_backend("cpu"),
    "tpu_interpret": functools.partial(tpu.ragged_paged_attention_tpu, interpret=True),
    "gpu_interpret": functools.partial(gpu.ragged_paged_attention_gpu, interpret=True),
}


def _latent_case(rng, *, kv_heads: int = 1, heads: int = 8, head_dim: int = LATENT + ROPE):
    case = make_case(rng, MIXED + [(9, 21)], num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     page_size=4, max_seqs=8, extra_rows=3, poison=True)
    scramble_padding(case)
    return case


def _oracle(case, v_head_dim: int, dtype=np.float32, pages=None) -> np.ndarray:
    """numpy_oracle with V = the first v_head_dim lanes of K's rows (`pages`: K as the kernels read it)."""
    values = copy.copy(case)
    if pages is not None:
        values.k_pages = pages
    values.v_pages = np.concatenate([values.k_pages[..., :v_head_dim],
                                     np.zeros_like(values.k_pages[..., v_head_dim:])], axis=-1)
    return numpy_oracle(values, dtype=dtype)[..., :v_head_dim]


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_values_read_from_the_key_rows_match_the_oracle(backend, dtype, kv_heads):
    rng = fresh_rng()
    case = _latent_case(rng, kv_heads=kv_heads)
    q, k, _, *meta = case.args(dtype)
    out = BACKENDS[backend](q, k, None, *meta, sm_scale=case.sm_scale, v_head_dim=LATENT)
    assert out.shape == (q.shape[0], q.shape[1], LATENT) and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    live = case.num_live_rows
    assert_close(out[:live], _oracle(case, LATENT, dtype), rtol=1e-5 if dtype == jnp.float32 else 2e-2,
                 what=backend)
    assert np.all(out[live:] == 0.0)


@pytest.mark.parametrize("page_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_quantized_latent_rows_use_one_scale_for_keys_and_values(backend, page_dtype):
    """8-bit latent pages carry one scale per token (kv_cache: no V scales): it scales the logits and
    the values alike."""
    rng = fresh_rng()
    case = _latent_case(rng)
    q, k, _, *meta = case.args()
    pages, scales = quantize(k, page_dtype)  # scales [P, ps, KVH]
    scales = jnp.swapaxes(scales, 1, 2)  # [P, KVH, ps]
    out = BACKENDS[backend](q, pages, None, *meta, sm_scale=case.sm_scale, v_head_dim=LATENT, k_scales=scales)
    dequantized = np.asarray(pages.astype(jnp.float32) * jnp.swapaxes(scales, 1, 2)[..., None])
    live = case.num_live_rows
    assert_close(np.asarray(out)[:live], _oracle(case, LATENT, pages=dequantized), rtol=1e-5, what=backend)


def test_gpu_programs_split_a_wide_group_of_heads(monkeypatch):
    """Heads whose accumulators pass MAX_ACCUMULATOR_VALUES go to several programs (MLA's 128 heads of
    512 value lanes: two of 64); every split gives the reference's numbers."""
    rng = fresh_rng()
    case = _latent_case(rng, heads=32)
    q, k, _, *meta = case.args()
    want = ragged_paged_attention_reference(q, k, None, *meta, sm_scale=case.sm_scale, v_head_dim=LATENT)
    live = case.num_live_rows
    for block_q, budget, block_kv in ((1, 16 * LATENT, 8), (None, 2 * 8 * LATENT, 16)):  # block_kv: a new trace
        monkeypatch.setattr(blocks, "MAX_ACCUMULATOR_VALUES", budget)
        bq, _, heads = blocks.choose_blocks(num_tokens=q.shape[0], max_seqs=8, group_p=32, head_dim=48, page_size=4,
                                         itemsize=4, num_stages=2, block_q=block_q, v_head_dim=LATENT, shared=True)
        assert heads < 32 and bq * heads * LATENT <= budget
        out = gpu.ragged_paged_attention_gpu(q, k, None, *meta, sm_scale=case.sm_scale, v_head_dim=LATENT,
                                             block_q=block_q, block_kv=block_kv, interpret=True)
        assert_close(np.asarray(out)[:live], np.asarray(want)[:live], rtol=1e-5, what=f"{heads} heads a program")


def test_gpu_rows_in_lane_parts_with_separate_values_match_reference():
    """head_dim 80 = 64 + 16 lanes with its own V pages (a shape the GPU kernel took to the reference
    before rows were read in parts), sinks and a window included."""
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=6, num_kv_heads=2, head_dim=80, page_size=4, max_seqs=6,
                     extra_rows=2, poison=True)
    args = case.args()
    sinks = jnp.asarray(rng.normal(size=6), jnp.float32)
    kw = dict(sm_scale=case.sm_scale, sliding_window=7, sinks=sinks)
    out = gpu.ragged_paged_attention_gpu(*args, interpret=True, **kw)
    want = ragged_paged_attention_reference(*args, **kw)
    live = case.num_live_rows
    assert_close(np.asarray(out)[:live], np.asarray(want)[:live], rtol=1e-5)
    assert np.all(np.asarray(out)[live:] == 0.0)


@pytest.mark.parametrize("backend", ["reference", "tpu_interpret", "gpu_interpret"])
def test_bad_value_arguments_are_refused_by_name(backend):
    rng = fresh_rng()
    case = _latent_case(rng)
    q, k, v, *meta = case.args()
    fn = functools.partial(BACKENDS[backend], sm_scale=case.sm_scale)
    with pytest.raises(ValueError, match="v_scales must be None when v_pages is None"):
        fn(q, k, None, *meta, v_scales=jnp.ones((k.shape[0], 1, 4), jnp.float32))
    with pytest.raises(ValueError, match="v_head_dim"):
        fn(q, k, v, *meta, v_head_dim=LATENT)  # separate V pages carry their own width
    with pytest.raises(ValueError, match="v_head_dim"):
        fn(q, k, None, *meta, v_head_dim=LATENT + ROPE + 1)


# --- compiled for the targets at DeepSeek-V3's shapes -------------------------------------------

KV_LORA_RANK, ROPE_DIM = 512, 64
# (name, q heads a device, page size, latent dtype, tokens, max seqs, context): 128 heads over 8
# devices (16 a device) or one device (128); decode buckets and a prefill bucket
DEEPSEEK_CASES = [
    ("tp8-decode-ps16-bf16", 16, 16, jnp.bfloat16, 64, 64, 8192),
    ("tp8-decode-ps64-fp8", 16, 64, jnp.float8_e4m3fn, 256, 256, 32768),
    ("tp1-decode-ps128-bf16", 128, 128, jnp.bfloat16, 32, 32, 32768),
    ("tp1-prefill-ps64-fp8", 128, 64, jnp.float8_e4m3fn, 2048, 16, 16384),
]


def _latent_pages(q, page_dtype, page_size, head_dim, sharding, num_pages=2048):
    pages = jax.ShapeDtypeStruct((num_pages, page_size, 1, head_dim), page_dtype, sharding=sharding)
    scales = None
    if page_dtype != q.dtype:
        scales = jax.ShapeDtypeStruct((num_pages, 1, page_size), jnp.float32, sharding=sharding)
    return pages, scales


# every case on v6e and v5p, the decode ones on v5e too (16 GiB chips: the model spans many)
TPU_CASES = [(t, c) for t in ("v6e", "v5p") for c in DEEPSEEK_CASES] + [("v5e", c) for c in DEEPSEEK_CASES[:3]]


@pytest.mark.parametrize("target,case", TPU_CASES, ids=[f"{t}-{c[0]}" for t, c in TPU_CASES])
def test_latent_attention_compiles_for_tpu_within_vmem(target, case):
    """The Mosaic kernel over a TPU pool's latent rows (576 lanes stored in 640: kv_groups.pool_head_dim,
    latent), values their first 512 lanes: one page operand (a single DMA stream), in VMEM within the
    bound its blocks are chosen by, and no relayout of the pool (which 576-lane rows needed)."""
    _, heads, ps, page_dtype, tokens, max_seqs, context = case
    head_dim = 640
    q, _, _, *meta = tpu_args(target, head_dim=head_dim, kv_heads=1, group=heads, page_size=ps,
                              dtype=jnp.bfloat16, tokens=tokens, max_seqs=max_seqs, context=context)
    pages, scales = _latent_pages(q, page_dtype, ps, head_dim, _replicated(target))
    extra = {} if scales is None else {"k_scales": scales}
    fn = jax.jit(lambda q, k, *m, **kw: tpu.ragged_paged_attention_tpu(
        q, k, None, *m, sm_scale=0.1, v_head_dim=KV_LORA_RANK, **kw))
    lowered = fn.lower(q, pages, *meta, **extra)
    hlo = lowered.compile().as_text()
    limit, used = _kernel_vmem(hlo)
    assert limit == tpu.VMEM_BUDGET_BYTES[target]
    sizes = dict(head_dim=head_dim, num_kv_heads=1, group=heads, page_size=ps, dtype=jnp.bfloat16,
                 page_dtype=page_dtype, v_head_dim=KV_LORA_RANK)
    bq, npb = tpu.choose_blocks(**sizes, max_pages_per_seq=context // ps, budget=limit)
    bound = tpu.vmem_bytes(**sizes, block_q=bq, pages_per_block=npb)
    assert 0 < used <= bound <= limit, (used, bound, limit, bq, npb)
    assert not _kv_cache_copies(hlo, (q, pages))
    call = next(l for l in lowered.as_text().splitlines() if "tpu_custom_call" in l)
    operands = call.rsplit(" : (", 1)[1]
    short = "bf16" if page_dtype == jnp.bfloat16 else "f8E4M3FN"
    assert operands.count(f"tensor<2048x{ps}x{head_dim}x{short}>") == 1, operands[:400]  # read once
    assert f"x{KV_LORA_RANK}xbf16>" in operands.rsplit("->", 1)[1]  # the output holds the value lanes only


def test_shared_values_need_half_the_tpu_page_buffers():
    """The VMEM bound the blocks are chosen by counts one page buffer (and one scale buffer) when the
    values are the keys' rows: larger blocks fit the same budget."""
    sizes = dict(head_dim=640, num_kv_heads=1, group=16, page_size=64, dtype=jnp.bfloat16, page_dtype=jnp.int8)
    separate = tpu.vmem_bytes(**sizes, block_q=16, pages_per_block=2)
    shared = tpu.vmem_bytes(**sizes, block_q=16, pages_per_block=2, v_head_dim=KV_LORA_RANK)
    page_buffers = 2 * 2 * 64 * 640 * 2  # [2 slots, NPB, ps, D in whole lane tiles], sized as bf16
    assert separate - shared >= page_buffers


# every case on an H100, two on an H200 (the same sm_90a; its own compile-only target)
GPU_CASES = [("h100", c) for c in DEEPSEEK_CASES] + [("h200", c) for c in DEEPSEEK_CASES[1::2]]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("kind,case", GPU_CASES, ids=[f"{k}-{c[0]}" for k, c in GPU_CASES])
def test_latent_attention_compiles_for_sm90(kind, case, tmp_path):
    """The Triton kernel over latent rows of 576 lanes (512 + 64 parts), values the first 512: sm_90a,
    within its shared-memory estimate, accumulators within MAX_ACCUMULATOR_VALUES."""
    name, heads, ps, page_dtype, tokens, max_seqs, context = case
    device = gpu_target.gpu_devices(kind, "1x1x1")[0]
    sharding = SingleDeviceSharding(device)
    head_dim = KV_LORA_RANK + ROPE_DIM

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    q = sds((tokens, heads, head_dim), jnp.bfloat16)
    pages, scales = _latent_pages(q, page_dtype, ps, head_dim, sharding)
    meta = (sds((max_seqs,), jnp.int32), sds((max_seqs + 1,), jnp.int32), sds((max_seqs, context // ps), jnp.int32),
            sds((1,), jnp.int32))
    extra = {} if scales is None else {"k_scales": scales}
    fn = jax.jit(lambda q, k, *m, **kw: gpu.ragged_paged_attention_gpu(
        q, k, None, *m, sm_scale=0.1, v_head_dim=KV_LORA_RANK, **kw))
    start = time.perf_counter()
    with jax.default_device(device):
        lowered = fn.lower(q, pages, *meta, **extra)
    compiled = lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    smem, target = _kernel_report(tmp_path)
    bq, bk, hb = blocks.choose_blocks(num_tokens=tokens, max_seqs=max_seqs, group_p=heads, head_dim=head_dim,
                                   page_size=ps, itemsize=2, num_stages=2, v_head_dim=KV_LORA_RANK, shared=True,
                                   page_itemsize=jnp.dtype(page_dtype).itemsize)
    estimate = blocks.shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=head_dim, itemsize=2,
                                       num_stages=2, kv_blocks=1, page_itemsize=jnp.dtype(page_dtype).itemsize)
    print(f"\n{name}: {time.perf_counter() - start:.1f} s, block_q={bq} block_kv={bk} heads={hb}, "
          f"shared memory {smem} B (estimate {estimate} B)")
    assert target == "sm_90a"
    assert smem <= estimate <= blocks.MAX_SHARED_MEMORY
    assert bq * hb * KV_LORA_RANK <= blocks.MAX_ACCUMULATOR_VALUES
    assert compiled.out_info.shape == (tokens, heads, KV_LORA_RANK)
