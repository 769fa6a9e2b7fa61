"""Frozen configuration: the model (read from a Hugging Face `config.json`) and the engine.

`ModelConfig.from_hf` accepts transformers-5 style configs (`rope_parameters`, `dtype`) and older
ones (`rope_theta` + `rope_scaling`, `torch_dtype`), family by family (hf_families.py). Anything we
cannot serve faithfully raises a `ValueError` that names the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxserve.core import buckets
from jaxserve.core.hf_families import parse_hf_config
from jaxserve.core.kv_groups import KVGroups, kv_groups
from jaxserve.core.layer_kinds import LayerKind, LinearAttentionConfig, MLAConfig, MoEConfig, RopeConfig
from jaxserve.quant import kv as kv_quant
from jaxserve.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from jaxserve.quant.scheme import WeightQuant

VOCAB_PAD = 128



@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool            # q/k/v projections carry a bias (Qwen2 always; Llama/Qwen3 via attention_bias)
    o_bias: bool              # o_proj carries a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool
    # RMSNorm on q and k before RoPE: "" none, "head" over each head (Qwen3, Gemma 3), "projection"
    # over the whole q / k projection (OLMo 2)
    qk_norm: str
    layers: tuple[LayerKind, ...]  # per layer: its attention window and RoPE
    dtype: str = "float32"    # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: WeightQuant | None = None  # quantized weights (quant/scheme.py); None: full precision
    moe: MoEConfig | None = None  # sparse MLP layers (layer_kinds.MoEConfig); None: every MLP dense
    # Where a block's RMSNorms sit: "pre" (on its input: Llama), "sandwich" (on its input and on its
    # output before the residual add: Gemma 2/3), "post" (on its output only: OLMo 2)
    norm_placement: str = "pre"
    # How an RMSNorm applies its weight: "llama" (cast to the dtype, then x weight), "float32"
    # (x weight in float32, then cast: OLMo 2), "gemma" (x (1 + weight) in float32, then cast)
    norm_style: str = "llama"
    mlp_act: str = "silu"     # the gated MLP's activation: "silu" | "gelu_tanh" (Gemma)
    embed_scale: float | None = None       # embeddings x this (Gemma: sqrt(hidden_size), in the dtype)
    attention_scale: float | None = None   # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None     # attention logits -> cap * tanh(logits / cap) (Gemma 2)
    final_soft_cap: float | None = None    # the lm_head's logits, likewise
    attention_sinks: bool = False          # a learned logit per q head that takes softmax mass (gpt-oss)
    # The KV pool as one layer group whatever the windows (sliding layers then keep every page): a
    # draft model, whose steps read the target's first group's tables, is set so (kv_groups.py)
    single_kv_group: bool = False
    # multi-head latent attention (layer_kinds.MLAConfig); then num_kv_heads is 1 and head_dim is
    # the latent row's width: the pool holds one latent row per token, read as MQA's only K and V head
    mla: MLAConfig | None = None
    # Gated DeltaNet linear attention (layer_kinds.LinearAttentionConfig) for the layers whose kind
    # says "linear" (Qwen3-Next, Qwen3.5); None: every layer attends over K/V pages
    linear: LinearAttentionConfig | None = None
    # the attention's output x sigmoid(gate), the gate a second q projection (Qwen3-Next, Qwen3.5)
    attn_output_gate: bool = False

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(kind.window for kind in self.layers)

    @functools.cached_property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state instead of K/V pages, in order (a layer's index in
        this tuple is its place in the state cache)."""
        return tuple(i for i, kind in enumerate(self.layers) if kind.linear)

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The windows of the layers that read K/V pages (linear layers left out)."""
        return tuple(kind.window for kind in self.layers if not kind.linear)

    @functools.cached_property
    def kv_groups(self) -> KVGroups:
        """The KV pool's layer groups (kv_groups.py): sliding layers keep only their window; linear
        layers have none."""
        windows = self.layer_windows
        paged = tuple(not kind.linear for kind in self.layers)
        if self.single_kv_group or len(set(self.attention_windows)) <= 1:
            first = None if self.single_kv_group or not self.attention_windows else self.attention_windows[0]
            return kv_groups((first,) * self.num_layers, paged)
        return kv_groups(windows, paged)

    @property
    def rope(self) -> RopeConfig:
        """The RoPE that sets the context: the first full-attention layer's that has one."""
        ropes = [k.rope for k in self.layers if k.rope is not None]
        return next((k.rope for k in self.layers if k.window is None and k.rope is not None),
                    ropes[0] if ropes else RopeConfig())

    def rotary_dim(self, rope: RopeConfig) -> int:
        """The dims of each head that `rope` rotates (MLA: its RoPE key's, apart from the latent)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else rope.rotary_dim(self.head_dim)

    @property
    def kv_arrays_per_layer(self) -> int:
        """Pool arrays a layer writes per token: K and V, or MLA's one latent row (read as both)."""
        return 1 if self.mla is not None else 2

    @property
    def scale(self) -> float:
        """The attention softmax's scale."""
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary padded to a multiple of VOCAB_PAD, so it splits evenly over the model axis."""
        return math.ceil(self.vocab_size / VOCAB_PAD) * VOCAB_PAD

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any]) -> "ModelConfig":
        """Reads a HF `config.json` (a path to the file or its directory, or the parsed dict)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"model config not found: {path}")
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls(**parse_hf_config(config))


# How long a PD decode instance waits for a prompt's pages (the HTTP export, and with `jax` the pull).
KV_TRANSFER_TIMEOUT_S = 30.0
LOAD_FORMATS = ("auto", "dummy")  # read the checkpoint; random weights drawn on the devices (checkpoints/random_init.py)
WARMUP_MODES = ("full", "background")
# EngineConfig fields no compiled program depends on (the host's scheduling, logging, limits and
# paths; the pool's memory settings, which reach programs only through the resolved num_kv_pages)
HOST_ONLY_FIELDS = frozenset({
    "model_id", "enable_prefix_caching", "scheduling_policy", "load_format", "kv_offload_gib", "kv_role",
    "compilation_cache_dir", "max_waiting_requests", "seed", "async_scheduling", "lora_modules", "max_cpu_loras",
    "memory_utilization", "kv_cache_memory", "warmup"})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: KV pool, per-step budgets, declared buckets, mesh.

    Fields left None are sized from the machine and the model when the engine starts
    (`capacity.plan_capacity`; the start-up log says what was chosen and why)."""

    model_id: str = "model"
    page_size: int = 16
    num_kv_pages: int | None = None          # None: from kv_cache_memory, else from memory_utilization
    kv_cache_memory: int | None = None       # bytes for the whole pool (per device)
    memory_utilization: float | None = None  # share of device memory (CPU: of available RAM) for the engine
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None         # None: the model's max_position_embeddings (bounded by the pool)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"          # "fcfs" | "priority"
    dtype: str | None = None                 # None: float32 on CPU, the checkpoint's dtype elsewhere
    quantization: str | None = None          # online weight quantization: "int8" | "int4" | "fp8" (quant/scheme.py)
    load_format: str = "auto"                # "auto": read the checkpoint; "dummy": random weights drawn on the devices
    kv_cache_dtype: str = "auto"             # KV pages: "auto" (compute dtype) | "int8" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    kv_offload_gib: float | None = None      # host-memory KV tier (GiB): evicted cached pages kept there (page_allocator.py)
    kv_role: str | None = None               # PD disaggregation: "prefill" (exports pages) | "decode" (imports them)
    mesh_shape: tuple[int, int] = (1, 1)     # (data, model)
    layout: str = "tp"                       # logical-axis rules (layouts.RULE_SETS): how the mesh splits the model
    attention_backend: str = "auto"          # "auto" | "reference" | "tiled" | "cpu" | "tpu" | "gpu"
    token_buckets: tuple[int, ...] | None = None   # None: the geometric ladder (buckets.py)
    seq_buckets: tuple[int, ...] | None = None     # None: the geometric ladder (buckets.py)
    compilation_cache_dir: str | None = None  # None: the user's cache dir; "": no persistent cache
    max_waiting_requests: int = 1024
    seed: int = 0
    async_scheduling: bool = True            # plan and dispatch step n+1 while step n runs on the device
    # speculative decoding: a SpeculativeConfig, or its JSON text / dict (vLLM's shape); None: off
    speculative_config: SpeculativeConfig | None = None
    # multi-LoRA: adapters (name, PEFT directory) loaded at start-up into max_loras slots of rank max_lora_rank
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4                       # device slots
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None         # adapters kept in host memory (LRU; None: max_loras)
    # "full": every program compiled before serving; "background": the smallest bucket, then the
    # rest on a thread while steps run on the buckets ready (runner/background_compile.py)
    warmup: str = "full"

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError(f"--max-loras and --max-lora-rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be distinct, got {names}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_pages",
                     "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.kv_offload_gib is not None and not self.kv_offload_gib > 0:
            raise ValueError(f"--kv-offload-gib must be > 0, got {self.kv_offload_gib}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"--kv-role must be prefill or decode, got {self.kv_role!r}")
        if self.kv_role is not None and not self.enable_prefix_caching:
            raise ValueError("--kv-role needs prefix caching (shipped pages are found by their prefix keys)")
        if self.kv_offload_gib is not None and not self.enable_prefix_caching:
            raise ValueError("--kv-offload-gib needs prefix caching (its pages are found by their prefix keys): "
                             "drop --no-enable-prefix-caching")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"EngineConfig.memory_utilization must be in (0, 1], got {self.memory_utilization}")
        kv_quant.check_name(self.kv_cache_dtype)
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"--warmup must be one of {', '.join(WARMUP_MODES)}, got {self.warmup!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"EngineConfig.scheduling_policy must be 'fcfs' or 'priority', "
                             f"got {self.scheduling_policy!r}")
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError("EngineConfig.max_num_batched_tokens must be >= max_num_seqs "
                             "(every running sequence needs one decode token per step)")

    def program_fields(self) -> dict[str, Any]:
        """The fields that shape compiled programs (the program store's key): everything but what
        only the host reads, so `serve`, `LLM()` and `generate` with the same sizes share programs."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in HOST_ONLY_FIELDS}

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    def resolved_token_buckets(self) -> tuple[int, ...]:
        return buckets.token_buckets(self)

    def resolved_seq_buckets(self) -> tuple[int, ...]:
        return buckets.seq_buckets(self)
