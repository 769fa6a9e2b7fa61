"""Defaults sized from the machine and the model (capacity.py), the bucket ladder (buckets.py), and
the temporaries estimate against XLA's own memory analysis."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from engine_utils import greedy, run_all, tiny_model
from jaxserve.core import buckets, capacity
from jaxserve.core.capacity import MachineInfo, plan_capacity
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.engine.engine_core import EngineCore
from jaxserve.runner.machine import machine_info
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh

GIB = 1024 ** 3
# jaxserve-tiny's shape: Qwen3, hidden 256, 4 layers, 4 x 64 query heads, 2 KV heads, mlp 768
TINY = ModelConfig.from_hf({
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151_936, "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096})
CPU_2 = MachineInfo("cpu", "test cpu", memory_per_device=20 * GIB, cpu_cores=2, cpu_isa="avx2")


def test_flops_and_kv_arithmetic_by_hand():
    # per layer: q and o 256 x 256 each, k and v 256 x 128 each, mlp 3 x 256 x 768
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768
    assert capacity.flops_per_token(TINY) == 2 * 4 * per_layer == 6_291_456
    assert capacity.flops_per_sampled_row(TINY) == 2 * 256 * 151_936  # 151,936 is a multiple of 128
    assert capacity.kv_bytes_per_token(TINY, 4) == 2 * 4 * 2 * 64 * 4 == 4096
    assert capacity.kv_bytes_per_token(TINY, 4, model_axis=2) == 2048   # KV heads split over 2 devices
    assert capacity.kv_bytes_per_token(TINY, 4, model_axis=4) == 4096   # 4 does not divide 2 heads: replicated


def test_cpu_defaults_follow_the_model_flops():
    cap = plan_capacity(EngineConfig(), TINY, CPU_2, itemsize=4)
    e = cap.engine
    step_flops = 2 * 50e9 * 1.0                        # 2 AVX2 cores x nominal 50 GFLOP/s x 1 s
    assert step_flops / 6_291_456 > 2048               # -> the CPU ceiling of 2048 tokens
    assert e.max_num_batched_tokens == 2048
    assert e.max_num_seqs == 256
    assert e.max_model_len == 4096                     # the model's context
    # The CPU pool is capped at 2,048 tokens for each of the 256 sequences, 16 tokens a page.
    assert e.num_kv_pages == 256 * 2048 // 16
    assert cap.kv_pool_bytes == e.num_kv_pages * 16 * 4096
    assert e.resolved_token_buckets() == (16, 64, 256, 1024, 2048)
    assert e.resolved_seq_buckets() == (4, 16, 64, 128, 256)
    assert buckets.decode_rows(e) == (16, 32, 64, 128, 256)
    # 20 forwards (S <= T) + the decode shapes (32, 32) and (128, 128), 6 rows x 4 history widths, copy
    assert cap.num_programs == 5 * 5 - 5 + 2 + 6 * 4 + 1
    text = "\n".join(cap.lines)
    for needle in ("KV pool: 32768 pages", "max_num_seqs 256", "max_num_batched_tokens 2048", "forward programs",
                   "pads to <= 4.0 n"):
        assert needle in text


def test_a_bigger_model_gets_a_smaller_cpu_step():
    m105 = dataclasses.replace(TINY, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                               num_kv_heads=4, head_dim=64)  # the bench-105m preset
    assert capacity.flops_per_token(m105) == 2 * 8 * (512 * 64 * 24 + 3 * 512 * 1536) == 50_331_648
    e = plan_capacity(EngineConfig(), m105, CPU_2, itemsize=4).engine
    assert e.max_num_batched_tokens == 2048            # 100 GFLOP / 50.3 MFLOP = 1988 -> the nearest power of 2
    m140 = dataclasses.replace(m105, intermediate_size=2560)  # 70.4 MFLOP/token: 1420 -> 1024
    assert plan_capacity(EngineConfig(), m140, CPU_2, itemsize=4).engine.max_num_batched_tokens == 1024
    avx512 = dataclasses.replace(CPU_2, cpu_isa="avx512", cpu_cores=4)
    assert plan_capacity(EngineConfig(), m105, avx512, itemsize=4).engine.max_num_batched_tokens == 2048
    # 16 KiB of KV per token: the 4 GiB cap holds 262,144 tokens, below 256 x 2048
    assert e.num_kv_pages == 4 * GIB // (capacity.kv_bytes_per_token(m105, 4) * 16) == 16384
    big = dataclasses.replace(TINY, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                              num_kv_heads=8, head_dim=128)  # Qwen3-0.6B's shape
    e = plan_capacity(EngineConfig(), big, CPU_2, itemsize=4).engine
    assert e.max_num_batched_tokens == 1024            # the floor: 100 GFLOP is 111 of its tokens
    # 229 KiB of KV per token: 10 GiB (half the RAM) minus temporaries holds fewer than 256 x 256 tokens
    pool_tokens = e.num_kv_pages * 16
    assert pool_tokens < 256 * 256 and e.max_num_seqs == pool_tokens // 256


def test_explicit_settings_win():
    e = plan_capacity(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                   num_kv_pages=100), TINY, CPU_2, itemsize=4).engine
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len, e.num_kv_pages) == (8, 64, 512, 100)
    e = plan_capacity(EngineConfig(kv_cache_memory=64 * 2 ** 20), TINY, CPU_2, itemsize=4).engine
    assert e.num_kv_pages == 64 * 2 ** 20 // (4096 * 16)


def _line(cap, prefix: str) -> str:
    return next(line for line in cap.lines if line.startswith(prefix))


def test_a_cpu_pool_capped_by_tokens_names_that_cap_as_the_pools_size():
    """The token cap bounds the pool's total (max_num_seqs x 2048 here), not one sequence: the line
    gives the arithmetic and never reads as a per-sequence limit below max_model_len."""
    cap = plan_capacity(EngineConfig(), TINY, CPU_2, itemsize=4)
    e, pool = cap.engine, _line(cap, "KV pool:")
    assert e.max_model_len == 4096 and e.num_kv_pages * 16 == 256 * 2048
    assert (f"capped at the CPU pool size limit of {256 * 2048} tokens = max_num_seqs 256 x 2048 "
            "(a pool total; one sequence may still reach max_model_len 4096)") in pool
    assert "GiB (CPU_MAX_POOL_BYTES)" not in pool and "sequences x" not in pool
    # a context below the per-sequence share names max_model_len as the factor
    short = plan_capacity(EngineConfig(max_model_len=1024), TINY, CPU_2, itemsize=4)
    assert "limit of 262144 tokens = max_num_seqs 256 x max_model_len 1024)" in _line(short, "KV pool:")
    # one sequence always fits: the cap never drops below max_model_len (it used to lower it to 2048)
    one = plan_capacity(EngineConfig(max_num_seqs=1), TINY, CPU_2, itemsize=4)
    assert one.engine.max_model_len == 4096 and one.engine.num_kv_pages * 16 == 4096
    assert "limit of 4096 tokens = one sequence of max_model_len 4096)" in _line(one, "KV pool:")
    assert not any("lowered" in line for line in one.lines)
    conc = _line(cap, "max concurrency")
    assert conc.startswith("max concurrency at max_model_len 4096: 128.0 sequences") and "max_num_seqs 256" in conc


def test_a_cpu_pool_capped_by_bytes_names_only_the_byte_cap():
    m105 = dataclasses.replace(TINY, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                               num_kv_heads=4, head_dim=64)  # 16 KiB per token: 4 GiB < 256 x 2048 tokens
    cap = plan_capacity(EngineConfig(), m105, CPU_2, itemsize=4)
    pool = _line(cap, "KV pool:")
    assert cap.kv_pool_bytes == 4 * GIB
    assert pool.endswith("; capped at the CPU pool size limit of 4.00 GiB (CPU_MAX_POOL_BYTES))")
    assert "x 2048" not in pool and "tokens =" not in pool.split(";")[-1]


def test_8_bit_pages_sized_by_memory_claim_the_tokens_gained():
    """A pool read off a memory size holds more 8-bit tokens in it: the ratio of the page bytes."""
    plain_page = capacity.kv_bytes_per_token(TINY, 4) * 16
    int8_page = capacity.kv_bytes_per_token(TINY, 4, kv_cache_dtype="int8") * 16
    memory = 64 * 2 ** 20
    cap = plan_capacity(EngineConfig(kv_cache_memory=memory, kv_cache_dtype="int8"), TINY, CPU_2, itemsize=4)
    assert cap.engine.num_kv_pages == memory // int8_page
    line = _line(cap, "KV cache dtype int8:")
    assert line.endswith(f": {plain_page / int8_page:.2f}x the tokens of 32-bit pages in the same memory")
    assert "instead of" not in line
    # the free-memory budget of an accelerator, and a CPU pool bounded by its byte cap, are memory-sized too
    h200 = MachineInfo("gpu", "NVIDIA H200", memory_per_device=141 * GIB, memory_in_use=2 * GIB)
    gpu = plan_capacity(EngineConfig(kv_cache_dtype="int8"), TINY, h200, itemsize=2)
    ratio = capacity.kv_bytes_per_token(TINY, 2) / capacity.kv_bytes_per_token(TINY, 2, kv_cache_dtype="int8")
    assert _line(gpu, "KV cache dtype").endswith(f"{ratio:.2f}x the tokens of 16-bit pages in the same memory")
    wide = dataclasses.replace(TINY, num_layers=16, num_kv_heads=4, num_heads=8, head_dim=128)  # 16.5 KiB/token int8
    big = plan_capacity(EngineConfig(kv_cache_dtype="int8"), wide, CPU_2, itemsize=4)
    assert big.lines[2].endswith("(CPU_MAX_POOL_BYTES))") and "the same memory" in _line(big, "KV cache dtype")


def test_8_bit_pages_with_a_fixed_token_count_claim_the_memory_saved():
    """Capped by tokens (or num_kv_pages), an 8-bit pool holds the tokens compute-dtype pages would
    and takes less memory: the line gives both byte counts, not a token gain."""
    plain_page = capacity.kv_bytes_per_token(TINY, 4) * 16
    int8_page = capacity.kv_bytes_per_token(TINY, 4, kv_cache_dtype="int8") * 16
    for engine in (EngineConfig(kv_cache_dtype="int8"), EngineConfig(kv_cache_dtype="int8", num_kv_pages=1000)):
        cap = plan_capacity(engine, TINY, CPU_2, itemsize=4)
        pages = cap.engine.num_kv_pages
        assert pages == (256 * 2048 // 16 if engine.num_kv_pages is None else 1000)  # as many as 32-bit pages
        assert cap.kv_pool_bytes == pages * int8_page
        line = _line(cap, "KV cache dtype int8:")
        assert "x the tokens" not in line and "same memory" not in line
        assert (f"the pool's tokens take {capacity._gib(pages * int8_page)} instead of the "
                f"{capacity._gib(pages * plain_page)} 32-bit pages would take "
                f"({int8_page / plain_page:.2f}x the memory for the same tokens)") in line
    assert capacity._gib(32768 * int8_page) == "544.00 MiB" and capacity._gib(32768 * plain_page) == "2.00 GiB"


def test_accelerator_pool_is_the_memory_left_after_weights_and_temporaries():
    h200 = MachineInfo("gpu", "NVIDIA H200", memory_per_device=141 * GIB, memory_in_use=2 * GIB, cpu_cores=16)
    cap = plan_capacity(EngineConfig(), TINY, h200, itemsize=2)
    e = cap.engine
    assert (e.max_num_seqs, e.max_num_batched_tokens) == (256, 8192)   # >= 70 GiB: the large budget
    page = capacity.kv_bytes_per_token(TINY, 2) * 16
    exact = (int(0.9 * 141 * GIB) - 2 * GIB - cap.temp_bytes) // page
    assert e.num_kv_pages == capacity.stable_page_count(exact) and exact * 15 / 16 < e.num_kv_pages <= exact
    # a little more or less free memory gives the same pool, so restarts hit the compilation cache
    other = dataclasses.replace(h200, memory_in_use=2 * GIB + 50 * 2 ** 20)
    assert plan_capacity(EngineConfig(), TINY, other, itemsize=2).engine.num_kv_pages == e.num_kv_pages
    # LoRA slots (allocated after the pool) take their bytes out of its budget
    lora = plan_capacity(EngineConfig(), TINY, h200, itemsize=2, lora_bytes=3 * GIB)
    assert lora.engine.num_kv_pages == capacity.stable_page_count(exact - 3 * GIB // page)
    assert "- 3.00 GiB LoRA slots" in lora.lines[2]
    l4 = MachineInfo("gpu", "NVIDIA L4", memory_per_device=22 * GIB, memory_in_use=GIB)
    assert plan_capacity(EngineConfig(), TINY, l4, 2).engine.max_num_batched_tokens == 2048
    v6e = MachineInfo("tpu", "TPU v6 lite", memory_per_device=31 * GIB)
    assert plan_capacity(EngineConfig(), TINY, v6e, 2).engine.max_num_batched_tokens == 1024


def test_a_small_pool_bounds_context_and_sequences():
    # 1,000 pages x 16 = 16,000 tokens: below 4 full 4096-token sequences per ... 62 sequences of 256
    e = plan_capacity(EngineConfig(num_kv_pages=1000), TINY, CPU_2, itemsize=4).engine
    assert e.max_model_len == 4096 and e.max_num_seqs == 16_000 // 256
    e = plan_capacity(EngineConfig(num_kv_pages=100), TINY, CPU_2, itemsize=4)
    assert e.engine.max_model_len == 1600 and "max_model_len lowered" in "\n".join(e.lines)
    with pytest.raises(ValueError, match="less than max_model_len 4096"):
        plan_capacity(EngineConfig(num_kv_pages=100, max_model_len=4096), TINY, CPU_2, itemsize=4)


def test_no_page_fits_names_the_settings():
    full = MachineInfo("gpu", "NVIDIA L4", memory_per_device=22 * GIB, memory_in_use=21 * GIB)
    with pytest.raises(ValueError, match="memory-utilization"):
        plan_capacity(EngineConfig(), TINY, full, itemsize=2)
    with pytest.raises(ValueError, match="--kv-cache-memory 1000 bytes holds no KV page"):
        plan_capacity(EngineConfig(kv_cache_memory=1000), TINY, CPU_2, itemsize=4)
    with pytest.raises(ValueError, match="exceeds the model's context 4096"):
        plan_capacity(EngineConfig(max_model_len=8192), TINY, CPU_2, itemsize=4)
    dynamic_rope = dataclasses.replace(TINY.rope, rope_type="dynamic", factor=2.0)
    dynamic = dataclasses.replace(TINY, layers=tuple(dataclasses.replace(k, rope=dynamic_rope) for k in TINY.layers))
    assert plan_capacity(EngineConfig(), dynamic, CPU_2, itemsize=4).engine.max_model_len == 8192
    assert plan_capacity(EngineConfig(max_model_len=10_000), dynamic, CPU_2, itemsize=4).engine.max_model_len == 10_000


def test_bucket_ladder_bounds_padding_and_programs():
    assert buckets.geometric_buckets(16, 2048) == (16, 64, 256, 1024, 2048)
    assert buckets.geometric_buckets(16, 512) == (16, 64, 256, 512)
    assert buckets.geometric_buckets(16, 8) == (8,)
    cfg = EngineConfig(max_num_seqs=128, max_num_batched_tokens=1024, max_model_len=4096)
    pairs = buckets.declared_buckets(cfg)
    assert all(s <= t for t, s in pairs)
    assert len(pairs) <= 20
    for n in range(1, 1025):  # every step size pads to at most 4x (2x in the top two buckets)
        t = min(b for b in cfg.resolved_token_buckets() if b >= n)
        assert t <= max(16, 4 * n) and (n <= 256 or t <= 2 * n)
    # a step of n decodes pads its token rows no further than its sequence rows: 100 decodes run 128
    # tokens (not the 256 of the token ladder), while 100 tokens of 4 sequences keep 4 lm_head rows
    assert (128, 128) in pairs and (128, 4) not in pairs
    assert buckets.choose_bucket(pairs, 100, 100) == (128, 128)
    assert buckets.choose_bucket(pairs, 100, 4) == (256, 4)
    assert buckets.choose_bucket(pairs, 100, 50) == (256, 64)
    # decode steps: T = S = the smallest decode row count or sequence bucket that holds them, so a
    # step of n > 16 decodes runs fewer than 2n lm_head rows (17-32 decodes: 32, not 64)
    assert buckets.decode_rows(cfg) == (16, 32, 64, 128)
    for n in range(1, 129):
        s = min(b for b in (4, 16, 32, 64, 128) if b >= n)
        assert buckets.choose_bucket(pairs, n, n) == (max(16, s), s)
        assert buckets.choose_bucket(pairs, n, n)[1] <= max(16, 2 * n - 1)
    assert buckets.history_buckets(4096, 151_936) == [0, 64, 1024, 16384]
    assert buckets.history_buckets(40960, 151_936) == [0, 64, 1024, 16384, 151_936]  # capped at the vocab
    assert all(buckets.history_bucket(n, 151_936) in buckets.history_buckets(4096, 151_936)
               for n in range(0, 4096 + 300 + 64 + 64 + 1, 7))


def test_machine_info_on_this_cpu():
    info = machine_info(make_mesh(1, 1))
    assert info.platform == "cpu" and info.memory_per_device > 2 ** 28 and info.cpu_cores >= 1
    assert info.cpu_isa in capacity.CPU_FLOPS_PER_CORE and info.device_kind


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("cap"), "qwen3-qknorm", seed=2)
    return cfg, weights


def test_an_engine_without_sizes_resolves_them_logs_them_and_warms_exactly_the_counted_programs(tiny, caplog):
    cfg, weights = tiny
    caplog.set_level(logging.INFO, logger="jaxserve.runner.model_runner")
    core = EngineCore(cfg, weights, EngineConfig(max_model_len=64), make_mesh(1, 1))
    e = core.engine_cfg
    assert None not in (e.max_num_seqs, e.max_num_batched_tokens, e.num_kv_pages)
    assert "KV pool:" in caplog.text and "forward programs" in caplog.text
    totals = []
    core.runner.warmup(lambda done, total, what: totals.append(total))
    assert totals[-1] == core.runner.capacity.num_programs
    out = run_all(core, [Request("a", [3, 4, 5], greedy(4))])
    assert len(out["a"][0]) == 4


def test_temporaries_estimate_covers_xla_memory_analysis(tiny):
    """The planner's per-step estimate is an upper bound of what XLA allocates for the forward and
    the sampler at the largest bucket, and within 20x of it (not a uselessly loose bound)."""
    cfg, weights = tiny
    core = EngineCore(cfg, weights, EngineConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                                 num_kv_pages=64), make_mesh(1, 1))
    from jaxserve.core.buckets import history_buckets
    from jaxserve.core.buckets import Program
    t, s = max(core.runner.builder.buckets)
    widest = max(history_buckets(core.engine_cfg.max_model_len, cfg.vocab_size))
    forward = core.runner.compile(Program("forward", t, s)).memory_analysis().temp_size_in_bytes
    sampler = core.runner.compile(Program("sample", rows=s, history=widest)).memory_analysis().temp_size_in_bytes
    estimate = capacity.step_temp_bytes(cfg, t, s, 4)
    assert max(forward, sampler) <= estimate <= 20 * max(forward, sampler), (forward, sampler, estimate)
    assert np.isfinite(estimate)


def test_tpu_page_tables_bound_max_num_seqs_by_the_kernels_smem():
    """A TPU's kernel prefetches max_num_seqs x pages-per-sequence int32 entries into SMEM."""
    tpu = MachineInfo("tpu", "TPU v6 lite", memory_per_device=32 * GIB)
    long_ctx = plan_capacity(EngineConfig(max_model_len=32768), TINY_LONG, tpu, 2)
    assert long_ctx.engine.max_num_seqs == capacity.TPU_PAGE_TABLE_ENTRIES // 2048 == 117  # 32768 / 16 pages each
    assert any("SMEM" in line for line in long_ctx.lines)
    assert plan_capacity(EngineConfig(max_model_len=4096), TINY, tpu, 2).engine.max_num_seqs == 256  # 256 x 256 fit
    with pytest.raises(ValueError, match="--max-num-seqs 256 x 2048 pages per sequence"):
        plan_capacity(EngineConfig(max_model_len=32768, max_num_seqs=256), TINY_LONG, tpu, 2)


TINY_LONG = dataclasses.replace(TINY, max_position_embeddings=32768)


def test_tpu_page_table_bound_fits_the_kernels_smem_budget():
    """capacity.py (no jax) keeps its own copy of the kernel's SMEM limit: the largest page tables
    it allows, with the other scalars of a 256-row, 8192-token step, fit the kernel's budget."""
    import importlib
    rpa = importlib.import_module("kernels_pallas.ragged_paged_attention_tpu")
    rows = 256
    pages = capacity.TPU_PAGE_TABLE_ENTRIES // rows
    assert rpa.smem_bytes(max_seqs=rows, max_pages_per_seq=pages, num_q_blocks=8192 // 16) <= rpa.SMEM_BUDGET_BYTES
    assert rpa.smem_bytes(max_seqs=rows, max_pages_per_seq=pages * 2, num_q_blocks=1) > rpa.SMEM_BUDGET_BYTES
