"""Decode attention on the CPU as a native kernel (cpu_decode_attention.cc), called through jax.ffi.

The jnp decode path (ragged_paged_attention_tiled.jnp_decode_rows) is bounded by XLA:CPU's gather:
every page is copied into a gathered buffer before the dots read it, at ~10 GB/s where a plain
read runs at ~30 (docs/BENCHMARKS.md). The native kernel reads each sequence's pages in place.

The library is compiled from the source shipped in this package by the host's C++ compiler the
first time a process asks for it (-O3 -march=native: the machine it runs on), into
$XDG_CACHE_HOME/jaxserve/native/ under a name derived from the source, the compiler command, the
jaxlib version and the CPU's instruction sets (a home directory shared by different machines gets
one library per CPU kind), so a second process loads it in milliseconds. With no compiler
`available()` is False and the tiled jnp path serves (same numbers; `--attention-backend tiled`
chooses it anyway).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_quant import is_quantized
from kernels_pallas.ragged_paged_attention_tiled import jnp_decode_rows, tiled_backend

logger = logging.getLogger("jaxserve.attention")

TARGET = "jaxserve_cpu_decode_attention"
_SOURCE = Path(__file__).with_suffix(".cc")
_SYMBOL = "JaxserveCpuDecodeAttention"
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
# page dtypes the kernel reads (int8 with its scales); float8 pages take the jnp path
_PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve" / "native"


def _compiler() -> list[str] | None:
    cxx = os.environ.get("CXX") or "c++"
    command = shlex.split(cxx)
    return command if command and shutil.which(command[0]) else None


def _cpu_kind() -> str:
    """The machine and its instruction-set flags: what -march=native compiles for."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


_BUILD_LOCK = threading.Lock()  # one build per process: prepare()'s thread and the first trace wait for each other


def prepare() -> None:
    """Starts building the library on a thread of its own (nothing when it is built already or no
    compiler is here): on a cold start the C++ compile (~3-4 s on 2 cores) then runs beside the
    model's load instead of inside the first program's trace, which finds it built."""
    compiler = _compiler()
    if compiler is not None:
        threading.Thread(target=lambda: _build_quietly(compiler), name="jaxserve-native-kernel", daemon=True).start()


def _build_quietly(compiler: list[str]) -> None:
    try:
        build(compiler, _cache_dir())
    except (OSError, RuntimeError, subprocess.SubprocessError):
        pass  # available() builds again on first use and logs why it failed


def build(compiler: list[str], directory: Path) -> Path:
    """The library compiled from the shipped source (once per source / compiler / jaxlib: the name
    says which); built into a temporary file and renamed, so concurrent builds never see half a file."""
    with _BUILD_LOCK:
        return _build(compiler, directory)


def _build(compiler: list[str], directory: Path) -> Path:
    import jaxlib

    include = jax.ffi.include_dir()
    command = [*compiler, *_FLAGS, f"-I{include}"]
    key = hashlib.sha256(_SOURCE.read_bytes() + repr((command, jaxlib.__version__, _cpu_kind())).encode())
    key = key.hexdigest()[:24]
    path = directory / f"cpu_decode_attention-{key}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([*command, str(_SOURCE), "-o", tmp], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()[-5:]
            raise RuntimeError(f"{shlex.join(command)} failed:\n" + "\n".join(errors[:10]))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def available() -> bool:
    """Whether the native kernel is built, loaded and registered with XLA for the CPU (once per
    process; a failure is logged once and the jnp path serves)."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler (c++ or $CXX) on PATH: CPU decode attention runs the slower jnp path")
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build(compiler, _cache_dir())))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, _SYMBOL)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the native CPU decode attention did not build or load (%s): the jnp path serves", e)
        return False
    return True


def supports(k_pages: jax.Array) -> bool:
    return jnp.dtype(k_pages.dtype) in _PAGE_DTYPES


def decode_rows(q_rows: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array | None,
                v_scales: jax.Array | None, ctx: jax.Array, page_tables: jax.Array, *, sm_scale: float,
                sliding_window: int | None, soft_cap: float | None, sinks: jax.Array | None = None) -> jax.Array:
    """Every decode row's attention: q_rows [S, H, D] float32, ctx [S] int32 (0 for rows that are not
    decodes: they get zeros), page_tables [S, MP], sinks [H] float32 or None -> [S, H, D] float32."""
    if is_quantized(k_pages.dtype) and k_scales is None:
        raise ValueError("quantized pages need their scales")
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the native CPU decode attention is not available here (the log says why)")
    none = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_rows.shape, jnp.float32))
    return call(q_rows, k_pages, v_pages, none if k_scales is None else k_scales,
                none if v_scales is None else v_scales, none if sinks is None else sinks.astype(jnp.float32),
                ctx.astype(jnp.int32), page_tables.astype(jnp.int32),
                sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
                sliding_window=np.int32(sliding_window or 0), scaled=k_scales is not None,
                has_sinks=sinks is not None)


def _native_or_jnp_decode_rows(q_rows, k_pages, v_pages, k_scales, v_scales, ctx, page_tables, *, v_head_dim: int,
                               **kw) -> jax.Array:
    if not supports(k_pages):
        return jnp_decode_rows(q_rows, k_pages, v_pages, k_scales, v_scales, ctx, page_tables, v_head_dim=v_head_dim,
                               **kw)
    if v_pages is None:  # values are K's rows: the native kernel reads the same pages as V, keeps Dv lanes
        return decode_rows(q_rows, k_pages, k_pages, k_scales, k_scales, ctx, page_tables, **kw)[..., :v_head_dim]
    return decode_rows(q_rows, k_pages, v_pages, k_scales, v_scales, ctx, page_tables, **kw)


ragged_paged_attention_cpu = tiled_backend(
    _native_or_jnp_decode_rows, "ragged_paged_attention_cpu",
    """The tiled path with its decode rows from the native kernel (float32, bfloat16 and int8 pages;
    float8 pages keep the jnp decode; attention sinks and soft cap in both). Needs `available()`; runs on
    CPU devices only, and is opaque to XLA's partitioner (jaxserve.model.attention places it with
    shard_map like the other kernels).""")
