"""`--kv-cache-dtype`: what the KV pages store, how many bytes a token takes, and where it can run.

"auto" stores K/V in the compute dtype. The 8-bit choices store values plus one float32 scale per
token and KV head (kernels_pallas/kv_quant.py has the format and why), so a head of `head_dim`
values takes `head_dim + 4` bytes instead of `head_dim * itemsize`: with head_dim 128 the pool holds
1.94x the tokens of bf16 pages and 3.88x those of f32 pages in the same memory.
Host-side (no jax import): the planner and the config use it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
_STORAGE = {
    "int8": np.dtype(np.int8),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),        # the alias vLLM and SGLang use
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
SCALE_BYTES = 4  # one float32 scale per token and KV head
# NVIDIA GPUs convert float8 natively from compute capability 8.9 (Ada, Hopper) on; Triton rejects
# float8 e4m3 below it. TPUs and CPUs widen float8 in software: every generation compiles it
# (tests/kernels/test_rpa_tpu_compile.py).
GPU_FP8_MIN_CAPABILITY = (8, 9)


def check_name(name: str) -> str:
    """The name itself, or ValueError listing the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    return name


def storage_dtype(name: str, compute_dtype) -> np.dtype:
    """The dtype K/V pages are stored in: the compute dtype for "auto"."""
    check_name(name)
    return np.dtype(compute_dtype) if name == "auto" else _STORAGE[name]


def is_quantized(name: str) -> bool:
    return check_name(name) != "auto"


def bytes_per_head_token(name: str, head_dim: int, itemsize: int) -> int:
    """Bytes of one token's K (or V) for one KV head."""
    return head_dim + SCALE_BYTES if is_quantized(name) else head_dim * itemsize


def describe(name: str, head_dim: int, itemsize: int, *, pool_bytes: int | None = None,
             plain_bytes: int | None = None, same_tokens: bool = False) -> str:
    """The start-up line's words for it. 8-bit pages either hold more tokens in the same memory or
    the same tokens in less, never both, so the claim follows how the pool was sized:
    - by memory (the default, `jaxserve plan`'s advice, a pool sized from free memory or a byte
      budget): the tokens gained over compute-dtype pages;
    - with `same_tokens` (its token count was fixed: a token cap, num_kv_pages): `pool_bytes` against
      `plain_bytes`, what compute-dtype pages of the same tokens would take.
    Given both byte figures, the ratio is theirs (a draft model's K/V in the same pages counts too)."""
    if not is_quantized(name):
        return f"pages in the {8 * itemsize}-bit compute dtype (not quantized)"
    stored = f"{_STORAGE[name].name} values + a float32 scale per token and KV head"
    plain = f"{8 * itemsize}-bit pages"
    if same_tokens:
        if pool_bytes is None or plain_bytes is None:
            raise ValueError("same_tokens needs pool_bytes and plain_bytes")
        return (f"{stored}: the pool's tokens take {size_words(pool_bytes)} instead of the {size_words(plain_bytes)} "
                f"{plain} would take ({pool_bytes / plain_bytes:.2f}x the memory for the same tokens)")
    if pool_bytes is not None and plain_bytes is not None:
        gain = plain_bytes / pool_bytes
    else:
        gain = bytes_per_head_token("auto", head_dim, itemsize) / bytes_per_head_token(name, head_dim, itemsize)
    return f"{stored}: {gain:.2f}x the tokens of {plain} in the same memory"


def size_words(n: int) -> str:
    """GiB with two decimals, MiB below 1 GiB (a small pool or budget would read 0.00 GiB)."""
    return f"{n / 2 ** 30:.2f} GiB" if abs(n) >= 2 ** 30 else f"{n / 2 ** 20:.2f} MiB"


def check_platform(name: str, platform: str, device_kind: str, compute_capability: str | None) -> None:
    """ValueError when the devices cannot hold this KV dtype (checked at start-up, never a fallback)."""
    if not name.startswith("fp8") or platform != "gpu" or compute_capability is None:
        return
    major, minor = (int(x) for x in str(compute_capability).split(".")[:2])
    if (major, minor) < GPU_FP8_MIN_CAPABILITY:
        raise ValueError(f"--kv-cache-dtype {name} needs float8 support (compute capability "
                         f"{'.'.join(map(str, GPU_FP8_MIN_CAPABILITY))}+); {device_kind} is {compute_capability}. "
                         f"Use --kv-cache-dtype int8 or auto")


def platform_note(name: str, platform: str) -> str | None:
    """A warning for a choice that runs but runs slowly here (logged at start-up)."""
    if name.startswith("fp8") and platform == "cpu":
        return (f"--kv-cache-dtype {name} on a CPU: x86 has no float8 conversion, so attention widens the pages "
                "in software and decodes 1.6-2x slower than with int8 pages, which hold as many tokens "
                "(docs/BENCHMARKS.md); use --kv-cache-dtype int8 here")
    return None
