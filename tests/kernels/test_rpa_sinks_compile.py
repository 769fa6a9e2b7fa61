"""Attention sinks compiled, not interpreted, at gpt-oss's attention shapes: the Mosaic kernel for
TPU v5e, v6e and v5p (compile-only topologies) and the Triton kernel for an H100 and an H200
(compile-only GPUs, `gpu_compile`), on a CPU-only machine.

gpt-oss (20b and 120b): head_dim 64, 64 q heads over 8 KV heads, bf16, a 128-token sliding window
on every other layer, one sink per q head. Per device under tensor parallelism: 64/8 heads (TP 1),
16/2 (TP 4), 8/1 (TP 8: one KV head, the TPU's squeezed [P, ps, D] cache). An interpreter run says
nothing about lowering, so each case checks that the sinks reached the compiled kernel as an
operand, besides the budgets the other compile tests check (tests/kernels/test_rpa_tpu_compile.py,
test_rpa_gpu_compile.py).
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding
from test_rpa_gpu_compile import _abstract_args, _kernel_report
from test_rpa_tpu_compile import _args, _kernel_vmem, _replicated, rpa

from kernels_pallas._checks import next_power_of_two
from kernels_pallas.gpu_blocks import (
    MAX_SHARED_MEMORY,
    choose_blocks,
    shared_memory_bytes,
)
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu

HEAD_DIM, GROUP, WINDOW = 64, 8, 128
# name -> (kv heads per device, page size, tokens, max seqs, context, sliding window, page dtype)
CASES = {
    "tp1-prefill-window": (8, 16, 2048, 64, 8192, WINDOW, jnp.bfloat16),
    "tp4-mixed-full-int8": (2, 32, 256, 64, 16384, None, jnp.int8),
    "tp8-decode-window": (1, 128, 64, 64, 32768, WINDOW, jnp.bfloat16),
}


def _sinks_operand(num_q_heads: int) -> str:
    return f"f32[{num_q_heads}]"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target", ["v5e", "v6e", "v5p"])
def test_tpu_kernel_with_sinks_compiles_within_vmem_budget(target, case):
    kvh, ps, tokens, max_seqs, context, window, page_dtype = CASES[case]
    q, k, v, *meta = _args(target, head_dim=HEAD_DIM, kv_heads=kvh, group=GROUP, page_size=ps,
                           dtype=jnp.bfloat16, tokens=tokens, max_seqs=max_seqs, context=context)
    rep = _replicated(target)
    heads = kvh * GROUP
    extra = dict(sinks=jax.ShapeDtypeStruct((heads,), jnp.float32, sharding=rep))
    if page_dtype != jnp.bfloat16:
        k = v = jax.ShapeDtypeStruct(k.shape, page_dtype, sharding=rep)
        scales = jax.ShapeDtypeStruct((k.shape[0], kvh, ps), jnp.float32, sharding=rep)
        extra.update(k_scales=scales, v_scales=scales)
    fn = jax.jit(lambda q, k, v, *m, **kw: rpa.ragged_paged_attention_tpu(
        q, k, v, *m, sm_scale=HEAD_DIM ** -0.5, sliding_window=window, **kw))
    hlo = fn.lower(q, k, v, *meta, **extra).compile().as_text()

    call = next(l for l in hlo.splitlines() if "tpu_custom_call" in l and "ragged_paged_attention_tpu" in l)
    operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", call).group(1)
    assert operands.endswith(_sinks_operand(heads) + "{0}"), operands  # the sinks are the kernel's last input
    limit, used = _kernel_vmem(hlo)
    assert limit == rpa.VMEM_BUDGET_BYTES[target]
    sizes = dict(head_dim=HEAD_DIM, num_kv_heads=kvh, group=GROUP, page_size=ps, dtype=jnp.bfloat16,
                 page_dtype=page_dtype)
    bq, npb = rpa.choose_blocks(**sizes, max_pages_per_seq=context // ps, budget=limit)
    bound = rpa.vmem_bytes(**sizes, block_q=bq, pages_per_block=npb)
    assert 0 < used <= bound <= limit, (used, bound, limit, bq, npb)


def test_tpu_smem_bound_counts_the_sinks():
    base = dict(max_seqs=64, max_pages_per_seq=512, num_q_blocks=16)
    assert rpa.smem_bytes(**base, num_sinks=64) == rpa.smem_bytes(**base) + 4 * 128
    assert rpa.smem_bytes(**base, num_sinks=0) == rpa.smem_bytes(**base)


@functools.cache
def _gpu(kind: str):
    from jaxserve.planning import gpu_target

    return gpu_target.gpu_devices(kind, "1x1x1")[0]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_gpu_kernel_with_sinks_compiles_for_sm90(kind, case, tmp_path):
    kvh, ps, tokens, max_seqs, context, window, page_dtype = CASES[case]
    device = _gpu(kind)
    shape = dict(head_dim=HEAD_DIM, dtype=jnp.bfloat16, page_size=ps, group=GROUP, kv_heads=kvh, tokens=tokens,
                 max_seqs=max_seqs)
    q, k, v, *meta = _abstract_args(shape, device)
    sharding = SingleDeviceSharding(device)
    extra = dict(sinks=jax.ShapeDtypeStruct((kvh * GROUP,), jnp.float32, sharding=sharding))
    if page_dtype != jnp.bfloat16:
        k = v = jax.ShapeDtypeStruct(k.shape, page_dtype, sharding=sharding)
        scales = jax.ShapeDtypeStruct((k.shape[0], kvh, ps), jnp.float32, sharding=sharding)
        extra.update(k_scales=scales, v_scales=scales)
    fn = jax.jit(lambda q, k, v, *m, **kw: ragged_paged_attention_gpu(
        q, k, v, *m, sm_scale=HEAD_DIM ** -0.5, sliding_window=window, **kw))
    with jax.default_device(device):  # jax 0.11's Triton lowering reads its target from the default device
        lowered = fn.lower(q, k, v, *meta, **extra)
    gp = next_power_of_two(GROUP)
    page_itemsize = jnp.dtype(page_dtype).itemsize
    bq, bk, hb = choose_blocks(num_tokens=tokens, max_seqs=max_seqs, group_p=gp, head_dim=HEAD_DIM, page_size=ps,
                               itemsize=2, num_stages=2, page_itemsize=page_itemsize)
    call = next(l for l in lowered.as_text().splitlines() if "__gpu$xla.gpu.triton" in l)
    # the sinks laid out per program row, [KVH, Gp / head block, block_q * head block], reach the Triton call
    assert f"tensor<{kvh}x{gp // hb}x{bq * hb}xf32>" in call.rsplit(" : (", 1)[1], call[-400:]
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    smem, target = _kernel_report(tmp_path)
    estimate = shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=HEAD_DIM, itemsize=2,
                                   num_stages=2, page_itemsize=page_itemsize)
    assert target == "sm_90a"
    assert smem <= estimate <= MAX_SHARED_MEMORY, (smem, estimate)
