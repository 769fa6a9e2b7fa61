"""The GPU (Triton) ragged paged attention kernel compiled for an H100 (sm_90a) on a machine with no
GPU, at the shapes real models use; and its block choice, which keeps shared memory in bounds.

`gpu_compile` tests need JAX's CUDA plugin and JAX_PLATFORMS=cpu (tests/conftest.py sets it):

    pip install -e '.[test,gpu]' && JAX_PLATFORMS=cpu python -m pytest -m gpu_compile

Each case compiles the kernel through XLA's Triton pipeline for the compile-only H100 of
jaxserve.planning.gpu_target and then checks, from XLA's dump of that compile, that the kernel became sm_90a
PTX and that the shared memory Triton gave it is within the wrapper's estimate
(`shared_memory_bytes`), itself within the 227 KiB a block may use. The unmarked tests run in the
default suite (CPU, Pallas interpreter).
"""
from __future__ import annotations

import glob
import itertools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from rpa_cases import assert_close, fresh_rng, make_case, scramble_padding

from jaxserve.planning import gpu_target
from kernels_pallas._checks import next_power_of_two
from kernels_pallas.gpu_blocks import (
    MAX_ACCUMULATOR_VALUES,
    MAX_SHARED_MEMORY,
    choose_blocks,
    lane_parts,
    shared_memory_bytes,
    supports,
)
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference

# --- the shapes ---------------------------------------------------------------------------

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.float32, jnp.bfloat16)
PAGE_SIZES = (16, 32, 64, 128)
GROUPS = tuple(range(1, 9))  # q heads per kv head
KV_HEADS = (1, 2, 3, 4, 8, 16)
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # token bucket T
MAX_SEQS = (4, 8, 16, 32, 64, 128, 256)  # sequence bucket S
FEATURES = (dict(), dict(sliding_window=1024), dict(soft_cap=50.0),
            dict(sliding_window=4096, soft_cap=30.0))
# float32 dots in the kernel: "float32" is IEEE (FMA, what tests/conftest.py's "highest" default
# gives), "tensorfloat32" uses the tensor cores (jax's "default" precision, so what serving gets).
F32_PRECISIONS = ("float32", "tensorfloat32")
NUM_PAGES = 4096  # pool pages per layer; the largest case's K pool is 8 GiB (64-bit offsets)
MAX_MODEL_LEN = 8192


def _cases() -> list[dict]:
    """Every (head_dim, dtype, page_size) with the other sizes cycled through, so that every value
    of every list above appears at least once, plus the largest shared-memory shapes."""
    cases = []
    for i, (d, dtype, ps) in enumerate(itertools.product(HEAD_DIMS, DTYPES, PAGE_SIZES)):
        cases.append(dict(
            head_dim=d, dtype=dtype, page_size=ps,
            group=GROUPS[(3 * i + i // 8) % len(GROUPS)],  # each group in both dtypes
            kv_heads=KV_HEADS[(i // 2) % len(KV_HEADS)],
            tokens=TOKENS[(3 * i) % len(TOKENS)],
            max_seqs=MAX_SEQS[(5 * i) % len(MAX_SEQS)],
            features=FEATURES[(i // 3) % len(FEATURES)],
            precision=F32_PRECISIONS[(i // 2) % 2] if dtype == jnp.float32 else "default",
        ))
    # The largest q tile and kv pages (f32, head_dim 256, 8 heads per kv head, 128-token pages),
    # for a prefill and a decode bucket, and a group of 7 (padded to 8) in bf16.
    for precision in F32_PRECISIONS:
        cases.append(dict(head_dim=256, dtype=jnp.float32, page_size=128, group=8, kv_heads=16,
                          tokens=8192, max_seqs=256, features=FEATURES[3], precision=precision))
    cases.append(dict(head_dim=256, dtype=jnp.float32, page_size=128, group=8, kv_heads=16,
                      tokens=256, max_seqs=256, features=FEATURES[0], precision="float32"))
    cases.append(dict(head_dim=256, dtype=jnp.bfloat16, page_size=64, group=7, kv_heads=2,
                      tokens=4096, max_seqs=64, features=FEATURES[1], precision="default"))
    return cases


CASES = _cases()


def _case_id(c: dict) -> str:
    feats = "+".join(f"{k}={v}" for k, v in c["features"].items()) or "plain"
    dtype = "tf32" if c["precision"] == "tensorfloat32" else jnp.dtype(c["dtype"]).name
    return (f"{dtype}-d{c['head_dim']}-ps{c['page_size']}-g{c['group']}"
            f"-kvh{c['kv_heads']}-t{c['tokens']}-s{c['max_seqs']}-{feats}")


def test_case_matrix_covers_every_value():
    for key, values in (("head_dim", HEAD_DIMS), ("dtype", DTYPES), ("page_size", PAGE_SIZES),
                        ("group", GROUPS), ("kv_heads", KV_HEADS), ("tokens", TOKENS),
                        ("max_seqs", MAX_SEQS)):
        assert {c[key] for c in CASES} >= set(values), key
    for features in FEATURES:
        assert features in [c["features"] for c in CASES]
    assert {c["precision"] for c in CASES if c["dtype"] == jnp.float32} == set(F32_PRECISIONS)
    assert any(c["tokens"] <= 2 * c["max_seqs"] for c in CASES)  # decode-shaped buckets too
    assert all(supports(head_dim=c["head_dim"], page_size=c["page_size"]) for c in CASES)


# --- block choice (default suite) -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_default_blocks_fit_shared_memory(dtype):
    """Every supported head_dim, group (1-8 and MQA-wide ones up to 128), page size and bucket
    gets blocks Triton can take (>= 16 per dot dimension) within MAX_SHARED_MEMORY, with 1 or 2
    pipeline stages (the default), and with 3 for groups up to 64."""
    itemsize = jnp.dtype(dtype).itemsize
    for d, g, ps, (t, s), stages in itertools.product(
        (16, 32, 64, 128, 256), (*GROUPS, 16, 32, 64, 128), (1, 4, 16, 32, 64, 128, 256),
        ((16, 4), (256, 256), (8192, 256), (8192, 4)), (1, 2, 3),
    ):
        if stages == 3 and g > 64:
            continue
        gp = next_power_of_two(g)
        bq, bk, hb = choose_blocks(num_tokens=t, max_seqs=s, group_p=gp, head_dim=d, page_size=ps,
                                   itemsize=itemsize, num_stages=stages)
        assert bq * hb >= 16 and bk >= 16 and gp % hb == 0, (d, g, ps, t, s, bq, bk, hb)
        smem = shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=d,
                                   itemsize=itemsize, num_stages=stages)
        assert smem <= MAX_SHARED_MEMORY, (d, g, ps, t, s, stages, bq, bk, smem)
        assert bq * hb * d <= MAX_ACCUMULATOR_VALUES, (d, g, bq, hb)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_latent_rows_get_blocks_within_shared_memory_and_registers(dtype):
    """DeepSeek-V3's latent row (576 lanes, 512 of them values, read once as K and V) for 16-128 q
    heads a device, every page size and bucket: blocks Triton takes, within shared memory, and
    accumulators of at most MAX_ACCUMULATOR_VALUES (128 heads: two programs of 64)."""
    itemsize = jnp.dtype(dtype).itemsize
    for g, ps, (t, s), stages in itertools.product((16, 32, 64, 128), (16, 32, 64, 128),
                                                   ((16, 4), (256, 256), (8192, 256)), (1, 2)):
        bq, bk, hb = choose_blocks(num_tokens=t, max_seqs=s, group_p=g, head_dim=576, page_size=ps,
                                   itemsize=itemsize, num_stages=stages, v_head_dim=512, shared=True)
        assert bq * hb >= 16 and bk >= 16 and g % hb == 0, (g, ps, t, s, bq, bk, hb)
        assert bq * hb * 512 <= MAX_ACCUMULATOR_VALUES, (g, bq, hb)
        smem = shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=576, itemsize=itemsize,
                                   num_stages=stages, kv_blocks=1)
        assert smem <= MAX_SHARED_MEMORY, (g, ps, t, s, stages, bq, bk, hb, smem)


def test_supported_sizes():
    for d in (16, 32, 64, 128, 256, 48, 80, 96, 112, 192, 512, 576):  # one to three power-of-two parts
        assert all(supports(head_dim=d, page_size=ps) for ps in (1, 8, 16, 32, 64, 128, 256))
    assert lane_parts(576) == ((0, 512), (512, 64)) and lane_parts(80) == ((0, 64), (64, 16))
    for d in (8, 24, 72, 120, 640, 1024):  # a part under 16 lanes, four parts, wider than a latent row
        assert not supports(head_dim=d, page_size=16)
    assert not supports(head_dim=128, page_size=24)
    assert supports(head_dim=576, page_size=64, v_head_dim=512)
    assert not supports(head_dim=576, page_size=64, v_head_dim=500)  # values must end on a part


def _abstract_args(case_kw: dict, device=None):
    """ShapeDtypeStructs for a kernel call (on `device` when given)."""
    d, dt, ps = case_kw["head_dim"], case_kw["dtype"], case_kw["page_size"]
    t, s, kvh = case_kw["tokens"], case_kw["max_seqs"], case_kw["kv_heads"]
    h = case_kw["group"] * kvh
    sharding = SingleDeviceSharding(device) if device is not None else None

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    pages = case_kw.get("num_pages", NUM_PAGES)
    return (sds((t, h, d), dt), sds((pages, ps, kvh, d), dt), sds((pages, ps, kvh, d), dt),
            sds((s,), jnp.int32), sds((s + 1,), jnp.int32),
            sds((s, max(1, MAX_MODEL_LEN // ps)), jnp.int32), sds((1,), jnp.int32))


def test_oversized_blocks_raise_value_error_naming_them():
    """Explicit blocks past shared memory fail in the wrapper, before Triton, naming the knobs."""
    kw = dict(head_dim=256, dtype=jnp.float32, page_size=16, group=8, kv_heads=2, tokens=256,
              max_seqs=8, num_pages=64)
    args = _abstract_args(kw)
    fn = lambda bq, bk, st: jax.eval_shape(  # noqa: E731
        lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.0625, block_q=bq, block_kv=bk,
                                              num_stages=st), *args)
    with pytest.raises(ValueError, match=r"block_q=8, block_kv=128 .*num_stages=2.*head_dim=256"):
        fn(8, 128, 2)
    with pytest.raises(ValueError, match="shared memory"):
        jax.eval_shape(lambda *a: ragged_paged_attention_gpu(
            *a, sm_scale=0.0625, block_q=16, block_kv=64, num_stages=3), *args)
    fn(8, 16, 2)  # 4 * 256 * (64 + 64) bytes: fits
    fn(None, 32, 3)  # block_q shrinks (8 -> 2 tokens of 8 heads) to fit the given kv block


def test_kv_blocks_smaller_than_a_page_match_reference():
    """A 16-slot page read as 4- and 8-key blocks (the path 128-token pages take on a GPU)."""
    rng = fresh_rng()
    case = make_case(rng, [(1, 7), (1, 16), (5, 12), (6, 6), (3, 10), (9, 33)], num_q_heads=4,
                     num_kv_heads=2, head_dim=16, page_size=16, max_seqs=8, extra_rows=2,
                     poison=True)
    scramble_padding(case)
    args = case.args()
    for kw, blocks in ((dict(), dict(block_q=2, block_kv=4)),
                       (dict(sliding_window=5, soft_cap=2.0), dict(block_q=4, block_kv=8))):
        out = ragged_paged_attention_gpu(*args, sm_scale=case.sm_scale, interpret=True,
                                         **blocks, **kw)
        ref = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, **kw)
        out = np.asarray(out)
        live = case.num_live_rows
        assert_close(out[:live], np.asarray(ref)[:live], rtol=1e-5)
        assert np.all(out[live:] == 0.0)


# --- compile for an H100 (gpu_compile) ---------------------------------------------------------


@pytest.fixture(scope="module")
def h100():
    # Selected only with -m gpu_compile: without the CUDA plugin this fails with the install hint.
    return gpu_target.gpu_devices("h100", "1x1x1")[0]


def _kernel_report(dump_dir) -> tuple[int, str]:
    """(shared memory bytes, PTX .target) of the Triton kernel, from XLA's dump of one compile."""
    smem = None
    for path in glob.glob(f"{dump_dir}/*thunk_sequence*.txt"):
        m = re.search(r"ragged_paged_attention_gpu grid: .*shared_memory: (\d+) bytes", open(path).read())
        if m:
            smem = int(m.group(1))
    target = None
    for path in glob.glob(f"{dump_dir}/*.ptx"):
        text = open(path).read()
        if ".entry ragged_paged_attention_gpu" in text:
            target = re.search(r"^\.target (\S+)", text, re.M).group(1)
    if target is None:  # jax 0.11's XLA dumps no PTX by default: the module's target names its files
        for path in glob.glob(f"{dump_dir}/*_gpu_after_optimizations.txt"):
            m = re.search(r"\.sm_(\d+)\.(\d+)(a?)_gpu_after_optimizations", path)
            target = f"sm_{m.group(1)}{m.group(2)}{m.group(3)}" if m else None
    assert smem is not None and target is not None, f"no kernel in XLA's dump at {dump_dir}"
    return smem, target


@pytest.mark.gpu_compile
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_compiles_for_h100(h100, case, tmp_path):
    d, dt, ps, gp = case["head_dim"], case["dtype"], case["page_size"], next_power_of_two(case["group"])
    args = _abstract_args(case, h100)
    fn = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=d ** -0.5, **case["features"]))
    start = time.perf_counter()
    # the compile-only GPU as the default device: jax 0.11's Triton lowering reads its target there
    with jax.default_matmul_precision(case["precision"]), jax.default_device(h100):  # precision: read when traced
        lowered = fn.lower(*args)
    compiled = lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    seconds = time.perf_counter() - start
    smem, target = _kernel_report(tmp_path)
    bq, bk, hb = choose_blocks(num_tokens=case["tokens"], max_seqs=case["max_seqs"], group_p=gp,
                               head_dim=d, page_size=ps, itemsize=jnp.dtype(dt).itemsize, num_stages=2)
    estimate = shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=d,
                                   itemsize=jnp.dtype(dt).itemsize, num_stages=2)
    print(f"\n{_case_id(case)}: {seconds:.2f} s, block_q={bq} block_kv={bk}, "
          f"shared memory {smem} B (estimate {estimate} B), {target}")
    assert target == "sm_90a"
    assert smem <= estimate <= MAX_SHARED_MEMORY
    assert compiled.memory_analysis() is not None
    out = compiled.out_info
    assert out.shape == args[0].shape and out.dtype == args[0].dtype


# 8-bit pages with per-token scales (kernels_pallas/kv_quant.py): each page dtype with bf16 and f32
# queries, kv blocks of whole pages and of page slices.
QUANTIZED = [
    dict(head_dim=128, dtype=jnp.bfloat16, page_size=16, group=4, kv_heads=8, tokens=256, max_seqs=64,
         features={}, precision="float32"),
    dict(head_dim=64, dtype=jnp.float32, page_size=128, group=7, kv_heads=2, tokens=2048, max_seqs=32,
         features=dict(sliding_window=1024), precision="tensorfloat32"),
]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("page_dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", QUANTIZED, ids=[_case_id(c) for c in QUANTIZED])
def test_quantized_pages_compile_for_h100(h100, case, page_dtype, tmp_path):
    d, ps, gp = case["head_dim"], case["page_size"], next_power_of_two(case["group"])
    q, k, v, *meta = _abstract_args(case, h100)
    sharding = SingleDeviceSharding(h100)
    k = v = jax.ShapeDtypeStruct(k.shape, page_dtype, sharding=sharding)
    scales = jax.ShapeDtypeStruct((k.shape[0], k.shape[2], ps), jnp.float32, sharding=sharding)
    fn = jax.jit(lambda q, k, v, *m: ragged_paged_attention_gpu(
        q, k, v, *m[:4], sm_scale=d ** -0.5, k_scales=m[4], v_scales=m[5], **case["features"]))
    with jax.default_matmul_precision(case["precision"]), jax.default_device(h100):
        lowered = fn.lower(q, k, v, *meta, scales, scales)
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    smem, target = _kernel_report(tmp_path)
    itemsize = jnp.dtype(case["dtype"]).itemsize
    bq, bk, hb = choose_blocks(num_tokens=case["tokens"], max_seqs=case["max_seqs"], group_p=gp, head_dim=d,
                               page_size=ps, itemsize=itemsize, num_stages=2, page_itemsize=1)
    estimate = shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=d, itemsize=itemsize,
                                   num_stages=2, page_itemsize=1)
    assert target == "sm_90a"
    assert smem <= estimate <= MAX_SHARED_MEMORY, (smem, estimate)


@pytest.mark.gpu_compile
def test_unsupported_head_dim_falls_back_to_reference_on_h100(h100):
    """head_dim 72 (64 + 8: a part narrower than a dot): the GPU dispatch compiles the jnp reference."""
    import kernels_pallas

    case = dict(head_dim=72, dtype=jnp.bfloat16, page_size=16, group=4, kv_heads=8, tokens=256,
                max_seqs=16, num_pages=256)
    assert not supports(head_dim=72, page_size=16)
    fn = jax.jit(lambda *a: kernels_pallas._gpu_or_reference(*a, sm_scale=72 ** -0.5))
    compiled = fn.lower(*_abstract_args(case, h100)).compile()
    assert "__gpu$xla.gpu.triton" not in compiled.as_text()


@pytest.mark.gpu_compile
def test_sharded_matmul_compiles_on_two_h200s():
    """A jitted tensor-parallel MLP on a 1x1x2 H200 topology: the partitioner inserts the
    all-reduce, and memory_analysis reports the per-device buffers."""
    devices = gpu_target.gpu_devices("h200", "1x1x2")
    assert [d.device_kind for d in devices] == ["NVIDIA H200"] * 2
    mesh = Mesh(np.array(devices), ("model",))

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    x = sds((256, 1024), PartitionSpec())
    w_in = sds((1024, 4096), PartitionSpec(None, "model"))
    w_out = sds((4096, 1024), PartitionSpec("model", None))
    compiled = jax.jit(lambda x, a, b: jax.nn.gelu(x @ a) @ b).lower(x, w_in, w_out).compile()
    assert "all-reduce" in compiled.as_text()
    mem = compiled.memory_analysis()
    # Per device: x (replicated) plus half of each weight.
    assert mem.argument_size_in_bytes == 2 * (256 * 1024 + 1024 * 2048 + 2048 * 1024)
    assert mem.output_size_in_bytes == 2 * 256 * 1024
    assert mem.temp_size_in_bytes > 0
