"""Defaults from the machine and the model: KV pool size, batch limits, declared buckets.

Pure arithmetic (no jax): `machine.py` measures the machine, the engine passes the figures in, and
`plan_capacity` fills every field of the EngineConfig the user left unset (None), returning the
resolved config and the lines of the start-up block that say what was chosen and why.

The rules, in order (each one is skipped when the user set that value):
  1. max_model_len: the model's context (`max_position_embeddings`; x factor for dynamic RoPE).
  2. max_num_seqs / max_num_batched_tokens: per platform, like vLLM's server defaults
     (accelerators: 256 sequences, 2048 tokens per step on GPUs below 70 GiB, 8192 above, 1024 on
     TPU). A CPU also admits 256 sequences, so a burst is served together instead of late
     arrivals waiting for earlier requests to finish (the lm_head costs the same per generated
     token at any batch; only the inter-token latency grows with the batch). Its step budget
     comes from the model's FLOPs at a nominal per-core rate for the CPU's vector ISA: a step full
     of prefill tokens takes about CPU_STEP_SECONDS (1 s), between 1024 and 2048 tokens (the floor
     leaves prefill 3/4 of a step with 256 sequences decoding, so a burst's prompts keep moving).
  3. The KV pool: `memory_utilization` of the device memory (accelerators 0.9 of HBM; CPU 0.5 of
     the RAM available after the weights are loaded) minus what is already in use and the largest
     step's temporaries. On a CPU the pool's size is also capped at max_num_seqs x min(max_model_len,
     CPU_TOKENS_PER_SEQ) tokens (at least one max_model_len sequence: a cap on the total, not on
     any one sequence) and at CPU_MAX_POOL_BYTES (4 GiB, vLLM's CPU default): RAM is
     shared with the rest of the host, filling a larger pool slows every start, and pages beyond
     that only hold prefix-cache entries. A pool sized from free memory is rounded down to 5
     leading bits, so a restart gets the same pool, the same programs and persistent-cache hits.
  4. What the pool holds bounds the rest: max_model_len shrinks to the pool (when it was not
     given), and max_num_seqs to one sequence per MIN_TOKENS_PER_SEQ pooled tokens. On a TPU,
     max_num_seqs also shrinks so every row's page table fits the attention kernel's SMEM.
  5. Buckets (buckets.py): token buckets 16 x 4^k below half the budget, then half the budget and
     the budget; sequence buckets likewise from 4 up to max_num_seqs. Padding is bounded (a step
     pads to at most 4x its tokens or rows, 2x in the top two buckets) and so is the number of
     compiled programs (logarithmic in both limits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jaxserve.core.buckets import declared_buckets, serving_programs
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.kv_groups import pool_head_dim
from jaxserve.quant import kv as kv_quant

GIB = 1024 ** 3
DEFAULT_MEMORY_UTILIZATION = {"cpu": 0.5, "gpu": 0.9, "tpu": 0.9}
DEFAULT_MAX_NUM_SEQS = 256         # every platform: a burst of 256 is admitted at once (BENCHMARKS)
GPU_LARGE_MEMORY = 70 * GIB        # vLLM gives H100/H200-class cards a larger step budget
# Nominal f32 matmul rate of one core under XLA, by vector ISA (machine.py reads the CPU flags):
# deliberately below the measured rates (~200 GFLOP/s per AVX-512 core on the benchmark EPYC) so a
# busy or throttled host still meets the step time. A fixed figure per ISA keeps the defaults, and
# so the compiled programs and their cache keys, the same at every start.
CPU_FLOPS_PER_CORE = {"avx512": 100e9, "avx2": 50e9, "other": 20e9}
ACCELERATOR_FLOPS = 100e12         # a nominal TPU/GPU rate for the swap-or-recompute estimate
HOST_COPY_BYTES_PER_S = {"cpu": 10e9, "gpu": 25e9, "tpu": 25e9}  # RAM memcpy; PCIe / host link
CPU_STEP_SECONDS = 1.0             # target time of a step full of prefill tokens on a CPU (see BENCHMARKS)
CPU_MIN_BATCHED_TOKENS = 1024      # with 256 sequences decoding, 3/4 of a step still prefills
CPU_MAX_BATCHED_TOKENS = 2048
CPU_MAX_POOL_BYTES = 4 * GIB       # the KV pool of a CPU engine: filling it is part of every start
CPU_TOKENS_PER_SEQ = 2048         # CPU pool cap: this many tokens for each of max_num_seqs sequences
MIN_TOKENS_PER_SEQ = 256           # the pool must give every running sequence at least this much
# The TPU attention kernel prefetches every row's page table into SMEM (1 MiB per core; the
# kernel's budget is 960 KiB, kernels_pallas/ragged_paged_attention_tpu.py): max_num_seqs x
# ceil(max_model_len / page_size) int32 entries, less what the other scalars take.
TPU_PAGE_TABLE_ENTRIES = 240_000


@dataclasses.dataclass(frozen=True)
class MachineInfo:
    """What the planner needs to know about where it runs (filled in by machine.py)."""

    platform: str                 # "cpu" | "gpu" | "tpu"
    device_kind: str              # e.g. "cpu", "NVIDIA H200", "TPU v6 lite"
    memory_per_device: int        # bytes: accelerator memory limit; CPU: RAM available now
    memory_in_use: int = 0        # bytes already taken on a device (weights included); 0 on CPU
    cpu_cores: int = 1
    cpu_isa: str = "other"        # "avx512" | "avx2" | "other": the nominal per-core rate (CPU_FLOPS_PER_CORE)


def swap_costs(machine: MachineInfo, weight_bytes: int, weight_itemsize: int, page_bytes: int) -> tuple[float, float]:
    """(seconds to prefill one token again, seconds to move one KV page to host memory and back):
    2 FLOPs per weight per token at the machine's nominal rate, 2 page copies at its host link's."""
    flops = (machine.cpu_cores * CPU_FLOPS_PER_CORE[machine.cpu_isa] if machine.platform == "cpu"
             else ACCELERATOR_FLOPS)
    return 2 * weight_bytes / weight_itemsize / flops, 2 * page_bytes / HOST_COPY_BYTES_PER_S[machine.platform]


@dataclasses.dataclass(frozen=True)
class Capacity:
    engine: EngineConfig          # every field resolved
    kv_pool_bytes: int            # per device
    temp_bytes: int               # estimated temporaries of the largest step, per device
    num_programs: int             # compiled at warm-up: forward buckets + sampler variants + page copy
    lines: tuple[str, ...]        # the start-up block


def model_context(cfg: ModelConfig) -> int:
    """The model's default context: max_position_embeddings, times the factor for dynamic NTK RoPE
    (which rescales itself to any length: only its default is bounded; yarn and llama3 configs
    already give the longer length)."""
    if cfg.rope.rope_type == "dynamic":
        return int(cfg.max_position_embeddings * cfg.rope.factor)
    return cfg.max_position_embeddings


def _sparse(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe is not None and cfg.moe.layers[layer]


def active_mlp_width(cfg: ModelConfig, layer: int) -> int:
    """The MLP width one token passes through in a layer: the dense intermediate size, or its top-k
    experts' widths (and the shared expert's) in a sparse MoE layer."""
    if not _sparse(cfg, layer):
        return cfg.intermediate_size
    return cfg.moe.top_k * cfg.moe.intermediate_size + cfg.moe.shared_size


def attention_weights_per_layer(cfg: ModelConfig) -> int:
    """Weights of one layer's attention projections, each multiplied once per token (MLA: absorbed,
    so the latent's up-projections count once per head, not once per cached token)."""
    d, hq = cfg.hidden_size, cfg.num_heads
    m = cfg.mla
    if m is None:
        return d * cfg.head_dim * (2 * hq + 2 * cfg.num_kv_heads)
    q = d * hq * m.qk_head_dim if m.q_lora_rank is None else m.q_lora_rank * (d + hq * m.qk_head_dim)
    return q + d * m.latent_dim + m.kv_lora_rank * hq * (m.qk_nope_head_dim + m.v_head_dim) + hq * m.v_head_dim * d


def linear_weights_per_layer(cfg: ModelConfig) -> int:
    """Weights of one Gated DeltaNet layer's projections (q, k, v, z, b, a in; out)."""
    lin = cfg.linear
    return cfg.hidden_size * (lin.conv_dim + 2 * lin.value_dim + 2 * lin.num_v_heads)


def flops_per_token(cfg: ModelConfig) -> int:
    """Matmul FLOPs of one token through the layers (attention scores excluded: context-dependent;
    a mixture of experts counts the experts a token is routed to; a linear-attention layer counts
    its projections, its recurrence is a few Dk x Dv products per head)."""
    d = cfg.hidden_size
    attn = attention_weights_per_layer(cfg) + (d * cfg.num_heads * cfg.head_dim if cfg.attn_output_gate else 0)
    mixer = lambda i: linear_weights_per_layer(cfg) if i in cfg.linear_layers else attn  # noqa: E731
    router = lambda i: d * cfg.moe.num_experts if _sparse(cfg, i) else 0  # noqa: E731
    return 2 * sum(mixer(i) + 3 * d * active_mlp_width(cfg, i) + router(i) for i in range(cfg.num_layers))


def flops_per_sampled_row(cfg: ModelConfig) -> int:
    """The lm_head product of one row that samples."""
    return 2 * cfg.hidden_size * cfg.padded_vocab_size


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int, model_axis: int = 1, kv_cache_dtype: str = "auto",
                       platform: str = "cpu") -> int:
    """A page's bytes per token slot, on one device of `platform`: K and V (MLA: the one latent row)
    of every pool array (every layer of a uniform stack; a stack of several layer groups shares
    arrays between them, kv_groups.py) at the head_dim the platform stores (kv_groups.pool_head_dim),
    KV heads split when the axis divides them; 8-bit pages (`kv_cache_dtype`) count their scales."""
    heads = cfg.num_kv_heads // model_axis if cfg.num_kv_heads % model_axis == 0 else cfg.num_kv_heads
    arrays = cfg.kv_groups.num_arrays
    head_dim = pool_head_dim(cfg.head_dim, platform, latent=cfg.mla is not None)
    return cfg.kv_arrays_per_layer * arrays * heads * kv_quant.bytes_per_head_token(kv_cache_dtype, head_dim, itemsize)


def linear_state_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """One recurrent-state slot's bytes on each device (a hybrid stack's; 0 without linear layers):
    per linear layer the conv window [K-1, C] in the compute dtype and the delta-rule state
    [Hv, Dk, Dv] in float32, replicated (model/state_cache.py)."""
    if cfg.linear is None:
        return 0
    lin = cfg.linear
    per_layer = (lin.conv_kernel - 1) * lin.conv_dim * itemsize + lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4
    return len(cfg.linear_layers) * per_layer


def state_slot_counts(model: ModelConfig, max_num_seqs: int, prefix_caching: bool) -> tuple[int, int]:
    """A hybrid stack's recurrent-state slots: (for running sequences, for prefix-cache snapshots).
    One per running sequence and one more for the moment a leader removed before its fork hands its
    role to a sibling; with prefix caching as many snapshots as sequences. (0, 0) without linear layers."""
    if model.linear is None:
        return 0, 0
    return max_num_seqs + 1, max_num_seqs if prefix_caching else 0


def step_temp_bytes(cfg: ModelConfig, tokens: int, rows: int, itemsize: int, model_axis: int = 1) -> int:
    """An upper estimate of a step's temporaries on one device: the forward's activations over
    `tokens` rows plus the logits and the sampler's vocab-wide arrays over `rows` rows (f32).
    Checked against XLA's memory analysis in tests/test_capacity.py."""
    d, hd = cfg.hidden_size, cfg.head_dim
    mlp = max(active_mlp_width(cfg, i) for i in range(cfg.num_layers))
    width = (4 * d + 2 * hd * (cfg.num_heads + 2 * cfg.num_kv_heads) // model_axis + 3 * mlp // model_axis
             + (2 * cfg.moe.top_k * d if cfg.moe is not None else 0))  # MoE: rows sorted by expert, outputs
    activations = tokens * width * max(itemsize, 4)
    vocab_arrays = 8 * rows * cfg.padded_vocab_size * 4  # logits, processed logits, CDF blocks, masks
    # The jnp attention path gathers K/V per chunk: decodes in chunks of up to 128 positions for
    # every row (at most ~2 MiB per gather), prefill tiles of 64 rows over 256 positions.
    kv_width = cfg.num_kv_heads * hd * 4
    decode_chunks = 6 * min(2 << 20, rows * 128 * kv_width)
    prefill_tile = 256 * (2 * kv_width + 64 * cfg.num_heads * 4)
    return activations + vocab_arrays + decode_chunks + prefill_tile


def stable_page_count(pages: int) -> int:
    """`pages` rounded down to its 5 leading bits (at most 1/16 less). The pool's size is a shape of
    every compiled step, so a size read off free memory must not change between starts when free
    memory moves a little, or each restart would miss the persistent compilation cache."""
    drop = max(0, pages.bit_length() - 5)
    return pages >> drop << drop


def _pow2_nearest(x: float) -> int:
    """The power of two nearest to x on a log scale (1988 -> 2048, 1400 -> 1024)."""
    return 1 << max(0, round(math.log2(max(1.0, x))))


def _platform_limits(model: ModelConfig, machine: MachineInfo) -> tuple[int, int, str]:
    """(max_num_seqs, max_num_batched_tokens, why) before the pool bounds them."""
    if machine.platform == "cpu":
        rate = CPU_FLOPS_PER_CORE[machine.cpu_isa]
        step_flops = rate * machine.cpu_cores * CPU_STEP_SECONDS
        tokens = _pow2_nearest(step_flops / flops_per_token(model))
        tokens = min(CPU_MAX_BATCHED_TOKENS, max(CPU_MIN_BATCHED_TOKENS, tokens))
        why = (f"CPU: {machine.cpu_cores} cores x {rate / 1e9:.0f} GFLOP/s nominal ({machine.cpu_isa}) x "
               f"{CPU_STEP_SECONDS}s per full step at {flops_per_token(model) / 1e6:.1f} MFLOP/token")
        return DEFAULT_MAX_NUM_SEQS, tokens, why
    if machine.platform == "gpu":
        tokens = 8192 if machine.memory_per_device >= GPU_LARGE_MEMORY else 2048
        return DEFAULT_MAX_NUM_SEQS, tokens, f"GPU {machine.device_kind} (vLLM's server defaults)"
    return DEFAULT_MAX_NUM_SEQS, 1024, f"TPU {machine.device_kind} (vLLM-TPU's server defaults)"


def plan_capacity(engine: EngineConfig, model: ModelConfig, machine: MachineInfo, itemsize: int,
                  model_axis: int = 1, draft: ModelConfig | None = None, lora_bytes: int = 0) -> Capacity:
    """Resolves every unset field of `engine` (see the module docstring). Raises ValueError when
    the settings cannot fit, naming the setting and the bytes. `draft`: a speculative draft model
    whose K/V shares the pool's pages (each token costs both models' bytes); `lora_bytes`: the LoRA
    slots one device holds (allocated after the pool, so not yet in machine.memory_in_use)."""
    adjustments = []  # limits lowered to what the pool holds
    context = model_context(model)
    max_model_len = engine.max_model_len or context
    if max_model_len > context and model.rope.rope_type != "dynamic":  # dynamic NTK rescales to any length
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context {context} "
                         f"(max_position_embeddings {model.max_position_embeddings}, RoPE {model.rope.rope_type})")
    seqs, tokens, why = _platform_limits(model, machine)
    max_num_batched_tokens = engine.max_num_batched_tokens or max(tokens, engine.max_num_seqs or 0)
    max_num_seqs = engine.max_num_seqs or min(seqs, max_num_batched_tokens)

    per_token = _pool_bytes_per_token(model, draft, itemsize, model_axis, engine.kv_cache_dtype, machine.platform)
    page_bytes = per_token * engine.page_size
    # a hybrid stack's recurrent states: a slot per sequence and its prefix-cache snapshots
    state_bytes = sum(state_slot_counts(model, max_num_seqs, engine.enable_prefix_caching)) * linear_state_bytes(
        model, itemsize)
    states_why = f" - {_gib(state_bytes)} recurrent-state slots" if state_bytes else ""
    probe = dataclasses.replace(engine, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                max_num_batched_tokens=max_num_batched_tokens)
    temp = max(step_temp_bytes(model, t, s, itemsize, model_axis)
               for t, s in declared_buckets(probe))
    utilization = engine.memory_utilization or DEFAULT_MEMORY_UTILIZATION[machine.platform]
    same_tokens = False  # the pool's token count was fixed rather than read off a memory size
    if engine.num_kv_pages is not None:
        num_pages, pool_why, same_tokens = engine.num_kv_pages, "set by num_kv_pages", True
    elif engine.kv_cache_memory is not None:
        num_pages = (engine.kv_cache_memory - state_bytes) // page_bytes
        pool_why = f"set by kv_cache_memory ({_gib(engine.kv_cache_memory)}{states_why})"
        if num_pages < 1:
            raise ValueError(f"--kv-cache-memory {engine.kv_cache_memory} bytes holds no KV page "
                             f"({page_bytes} bytes each)")
    else:
        budget = int(utilization * machine.memory_per_device) - machine.memory_in_use - temp - lora_bytes - state_bytes
        num_pages = stable_page_count(max(0, budget) // page_bytes)
        if num_pages < 1:
            raise ValueError(f"no KV page fits: {_gib(machine.memory_per_device)} x {utilization:.2f} leaves "
                             f"{_gib(budget)} after weights, temporaries and LoRA slots; each page needs {page_bytes} bytes. "
                             f"Raise --memory-utilization, lower --max-num-batched-tokens, or use more devices")
        where = "of available RAM" if machine.platform == "cpu" else "of device memory"
        pool_why = (f"{utilization:.2f} {where} ({_gib(machine.memory_per_device)}) - {_gib(machine.memory_in_use)} "
                    f"in use - {_gib(temp)} step temporaries"
                    + (f" - {_gib(lora_bytes)} LoRA slots" if lora_bytes else "") + states_why)
        if machine.platform == "cpu":
            num_pages, cap_why, same_tokens = _cpu_pool_cap(
                num_pages, page_bytes, engine.page_size, max_num_seqs, max_model_len,
                lambda tokens: model.kv_groups.pages_to_hold(tokens, engine.page_size, max_num_batched_tokens))
            pool_why += cap_why
    pool_tokens = num_pages * engine.page_size
    groups = model.kv_groups
    hold = lambda tokens: groups.pages_to_hold(tokens, engine.page_size, max_num_batched_tokens)  # noqa: E731
    seq_tokens = groups.max_tokens(num_pages, engine.page_size, max_num_batched_tokens, max_model_len)
    if seq_tokens < max_model_len:
        if engine.max_model_len is not None:
            raise ValueError(f"the KV pool holds {seq_tokens} tokens of a sequence ({num_pages} pages, {pool_why}), "
                             f"less than max_model_len {max_model_len}: lower --max-model-len or give the pool "
                             f"{(hold(max_model_len) - num_pages) * page_bytes} more bytes")
        adjustments.append(f"max_model_len lowered from {max_model_len} to the pool's {seq_tokens} tokens")
        max_model_len = seq_tokens
    if engine.max_num_seqs is None:
        bound = max(1, num_pages // hold(MIN_TOKENS_PER_SEQ))
        if bound < max_num_seqs:
            adjustments.append(f"max_num_seqs lowered from {max_num_seqs} to {bound}: the pool's {pool_tokens} "
                               f"tokens give each at least {MIN_TOKENS_PER_SEQ}")
            max_num_seqs = bound
    if machine.platform == "tpu":
        pages_per_seq = -(-max_model_len // engine.page_size)
        if max_num_seqs * pages_per_seq > TPU_PAGE_TABLE_ENTRIES:
            bound = max(1, TPU_PAGE_TABLE_ENTRIES // pages_per_seq)
            if engine.max_num_seqs is not None:
                raise ValueError(f"--max-num-seqs {max_num_seqs} x {pages_per_seq} pages per sequence "
                                 f"(--max-model-len {max_model_len} / --page-size {engine.page_size}) exceeds the "
                                 f"{TPU_PAGE_TABLE_ENTRIES} page-table entries the TPU kernel holds in SMEM: use "
                                 f"--max-num-seqs {bound} or fewer, a shorter --max-model-len or larger pages")
            adjustments.append(f"max_num_seqs lowered from {max_num_seqs} to {bound}: the TPU kernel's page "
                               f"tables (SMEM) hold {TPU_PAGE_TABLE_ENTRIES} entries, {pages_per_seq} per sequence")
            max_num_seqs = bound
    resolved = dataclasses.replace(engine, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, num_kv_pages=int(num_pages),
                                   memory_utilization=utilization)
    buckets = declared_buckets(resolved)
    programs = serving_programs(resolved, model)
    num_programs, num_forwards = len(programs), sum(p.kind == "forward" for p in programs)
    pool_bytes = int(num_pages) * page_bytes
    # what compute-dtype pages of the same tokens would take: the 8-bit line's comparison
    plain_bytes = pool_tokens * _pool_bytes_per_token(model, draft, itemsize, model_axis, "auto",
                                                      machine.platform)
    kv_words = kv_quant.describe(engine.kv_cache_dtype, model.head_dim, itemsize, pool_bytes=pool_bytes,
                                 plain_bytes=plain_bytes, same_tokens=same_tokens)
    lines = [
        f"machine: {machine.platform} ({machine.device_kind}), {_gib(machine.memory_per_device)} per device, "
        f"{machine.cpu_cores} cores",
        f"weights: {model.quantization.describe() if model.quantization else 'not quantized'}",
        f"KV pool: {num_pages} pages x {engine.page_size} tokens = {pool_tokens} tokens, {_gib(pool_bytes)} per "
        f"device ({pool_why})" + ("" if groups.num_groups == 1 and groups.windows[0] is None
                                  else f"; {groups.describe()}"),
        f"KV cache dtype {engine.kv_cache_dtype}: {kv_words}",
        f"max_model_len {max_model_len}; max_num_seqs {max_num_seqs}; max_num_batched_tokens "
        f"{max_num_batched_tokens} ({'set' if engine.max_num_batched_tokens else why})",
        _concurrency(groups.sequences_held(num_pages, max_model_len, engine.page_size, max_num_batched_tokens),
                     pool_tokens, max_model_len, max_num_seqs),
        f"buckets: tokens {list(resolved.resolved_token_buckets())} x seqs {list(resolved.resolved_seq_buckets())}"
        f" -> {num_forwards} forward programs{' (with draft rows)' if num_forwards > len(buckets) else ''}; a step of n >= {buckets[0][0]} tokens pads to <= "
        f"{_padding_bound(resolved):.1f} n; "
        f"{num_programs} programs in all",
        *adjustments,
    ]
    return Capacity(resolved, pool_bytes, temp, num_programs, tuple(lines))


def _pool_bytes_per_token(model: ModelConfig, draft: ModelConfig | None, itemsize: int, model_axis: int,
                          kv_cache_dtype: str, platform: str) -> int:
    """One token's bytes in the pool on one device: the model's K/V, plus the draft's that shares its pages."""
    per_token = kv_bytes_per_token(model, itemsize, model_axis, kv_cache_dtype, platform)
    if draft is not None:
        per_token += kv_bytes_per_token(draft, itemsize, model_axis, kv_cache_dtype, platform)
    return per_token


def _cpu_pool_cap(num_pages: int, page_bytes: int, page_size: int, max_num_seqs: int,
                  max_model_len: int, pages_for: Callable[[int], int]) -> tuple[int, str, bool]:
    """(pages, words for the pool line, whether the token cap fixed the pool's tokens) after a CPU's
    two caps on a pool sized from free memory. Both bound the pool's total, never one sequence's
    length, so the token cap holds at least one max_model_len sequence and the words name only the
    cap that bound, with its arithmetic."""
    per_seq = min(max_model_len, CPU_TOKENS_PER_SEQ)
    cap_tokens = max(max_num_seqs * per_seq, max_model_len)
    # pages_for(tokens): the pages a sequence of that length holds (per layer group; a sliding one
    # keeps its window's); a uniform stack's is the tokens' pages
    plain = -(-per_seq // page_size)
    token_pages = max(-(-cap_tokens // page_size) * pages_for(per_seq) // plain, pages_for(max_model_len))
    byte_pages = CPU_MAX_POOL_BYTES // page_bytes
    if num_pages <= min(token_pages, byte_pages):
        return num_pages, "", False
    if byte_pages < token_pages:
        return byte_pages, (f"; capped at the CPU pool size limit of {_gib(CPU_MAX_POOL_BYTES)} "
                            f"(CPU_MAX_POOL_BYTES)"), False
    if cap_tokens == max_model_len:
        terms = f"one sequence of max_model_len {max_model_len}"
    elif per_seq == max_model_len:
        terms = f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len}"
    else:  # a mean over the pool (CPU_TOKENS_PER_SEQ): any one sequence may still reach max_model_len
        terms = (f"max_num_seqs {max_num_seqs} x {per_seq} (a pool total; one sequence may still reach "
                 f"max_model_len {max_model_len})")
    rounded = ", rounded up to whole pages" if token_pages * page_size != cap_tokens else ""
    return token_pages, f"; capped at the CPU pool size limit of {cap_tokens} tokens = {terms}{rounded}", True


def _concurrency(fits: float, pool_tokens: int, max_model_len: int, max_num_seqs: int) -> str:
    """How many sequences of max_model_len run at once: what the pool holds (`fits`), at most max_num_seqs."""
    head = f"max concurrency at max_model_len {max_model_len}:"
    if fits >= max_num_seqs:
        plural = "s" if max_num_seqs != 1 else ""
        return f"{head} {max_num_seqs} sequence{plural}, max_num_seqs (the pool's {pool_tokens} tokens hold {fits:.1f})"
    return (f"{head} {fits:.1f} sequences, what the pool's {pool_tokens} tokens hold "
            f"(shorter ones: up to max_num_seqs {max_num_seqs})")


def _padding_bound(cfg: EngineConfig) -> float:
    """Worst ratio of a step's padded tokens to its real tokens, for steps of at least the smallest
    bucket (a step of b+1 tokens pads to the next bucket)."""
    tb = cfg.resolved_token_buckets()
    return max([1.0] + [hi / (lo + 1) for lo, hi in zip(tb, tb[1:])])


def _gib(n: int) -> str:
    return kv_quant.size_words(n)
