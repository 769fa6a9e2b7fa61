"""Frozen configuration: the model (read from a Hugging Face `config.json`) and the engine.

`ModelConfig.from_hf` accepts transformers-5 style configs (`rope_parameters`, `dtype`) and older
ones (`rope_theta` + `rope_scaling`, `torch_dtype`). Anything we cannot serve faithfully raises a
`ValueError` that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxserve.core import buckets
from jaxserve.quant import kv as kv_quant
from jaxserve.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from jaxserve.quant.scheme import WeightQuant

# architecture name -> family; a family fixes which optional parts exist (biases, q/k norms).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
VOCAB_PAD = 128
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                "float": "float32"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts MLPs (Qwen3-MoE, Mixtral): softmax over the router's logits, the
    top-k experts per token, their weights renormalised to sum to one where the model says so."""
    num_experts: int
    top_k: int
    intermediate_size: int         # each expert's MLP width
    renormalize: bool              # Mixtral always; Qwen3-MoE: norm_topk_prob
    layers: tuple[bool, ...]       # per layer: a sparse MoE block (else the dense MLP)


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
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool            # q/k/v projections carry a bias (Qwen2 always; Llama/Qwen3 via attention_bias)
    o_bias: bool              # o_proj carries a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool
    qk_norm: bool             # per-head RMSNorm on q and k before RoPE (Qwen3)
    layer_windows: tuple[int | None, ...]  # per-layer sliding window (None = full attention)
    dtype: str = "float32"    # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: WeightQuant | None = None  # quantized weights (quant/scheme.py); None: full precision
    moe: MoEConfig | None = None  # sparse MLP layers (Qwen3-MoE, Mixtral); None: every MLP dense

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
        return _parse_hf(config)


def normalize_dtype_name(name: str) -> str:
    """'bf16', 'torch.bfloat16', 'half', ... -> 'float32' | 'bfloat16' | 'float16'."""
    key = str(name).replace("torch.", "")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return _DTYPE_NAMES[key]


def _require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json is missing required field '{key}'")
    return cfg[key]


def _positive_int(cfg: dict, key: str) -> int:
    value = _require(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json field '{key}' must be a positive integer, got {value!r}")
    return value


def _parse_rope(cfg: dict, max_pos: int) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json field 'rope_parameters' is per layer type; only one RoPE for all layers "
                         "is supported")
    params = dict(params or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type '{rope_type}' in config.json (rope_parameters.rope_type); "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json field 'partial_rotary_factor' != 1.0 is not supported")
    factor = params.get("factor", 1.0)
    if rope_type != "default" and (factor is None or factor <= 0):
        if rope_type != "yarn":
            raise ValueError(f"RoPE type '{rope_type}' needs a positive 'factor', got {factor!r}")
    original = params.get("original_max_position_embeddings")
    if rope_type == "llama3" and original is None:
        raise ValueError("RoPE type 'llama3' needs 'original_max_position_embeddings'")
    if rope_type == "yarn":
        if original is None:
            original = max_pos
        if factor is None:
            factor = max_pos / original
    return RopeConfig(
        rope_type=rope_type, theta=float(theta), factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def _parse_moe(cfg: dict, family: str, num_layers: int) -> MoEConfig | None:
    """The MoE fields of a Qwen3-MoE or Mixtral config.json (None for dense families)."""
    if family == "mixtral":
        experts, width, renormalize = _positive_int(cfg, "num_local_experts"), _positive_int(cfg, "intermediate_size"), True
        layers = (True,) * num_layers
    elif family == "qwen3_moe":
        key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        experts, width = _positive_int(cfg, key), _positive_int(cfg, "moe_intermediate_size")
        renormalize = bool(cfg.get("norm_topk_prob", False))
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    else:
        return None
    top_k = _positive_int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"config.json num_experts_per_tok {top_k} exceeds the {experts} experts")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("config.json has shared experts (shared_expert_intermediate_size); not supported")
    return MoEConfig(experts, top_k, width, renormalize, layers)


def _layer_windows(cfg: dict, family: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if family in ("mistral", "mixtral"):
        return (window,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"config.json field 'layer_types' has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"config.json field 'layer_types' has unsupported entries {sorted(unknown)}")
        if "sliding_attention" in layer_types and not window:
            raise ValueError("config.json has sliding_attention layers but no 'sliding_window'")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if cfg.get("use_sliding_window") and window:
        # Older Qwen2 configs: layers from max_window_layers on use the window.
        first = cfg.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _parse_hf(cfg: dict) -> ModelConfig:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        if not archs and model_type in by_type:
            arch = by_type[model_type]
        else:
            raise ValueError(f"unsupported architecture {archs or model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported config.json 'hidden_act' {act!r}; only 'silu' is supported")
    hidden = _positive_int(cfg, "hidden_size")
    num_layers = _positive_int(cfg, "num_hidden_layers")
    num_heads = _positive_int(cfg, "num_attention_heads")
    num_kv = cfg.get("num_key_value_heads") or num_heads
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv})")
    head_dim = cfg.get("head_dim") or hidden // num_heads
    max_pos = _positive_int(cfg, "max_position_embeddings")
    raw_dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    try:
        dtype_name = normalize_dtype_name(raw_dtype)
    except ValueError:
        raise ValueError(f"unsupported config.json 'dtype' {raw_dtype!r}") from None
    attention_bias = bool(cfg.get("attention_bias", False))
    quantization = None
    if cfg.get("quantization_config") is not None:
        from jaxserve.quant.hf_config import scheme_from_hf
        quantization = scheme_from_hf(cfg["quantization_config"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch, family=family,
        vocab_size=_positive_int(cfg, "vocab_size"), hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"), num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_position_embeddings=max_pos,
        rope=_parse_rope(cfg, max_pos),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        layer_windows=_layer_windows(cfg, family, num_layers),
        dtype=dtype_name,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, quantization=quantization,
        moe=_parse_moe(cfg, family, num_layers),
    )


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
