"""Compile-only NVIDIA GPUs: target descriptions of the H100 and H200 (SXM) and their devices.

XLA's CUDA plugin compiles for a GPU it does not have when given a target description, the text
form of stream_executor's `GpuTargetConfigProto` (its `gpu_device_info` is a `GpuDeviceInfoProto`).
`gpu_devices("h200", "1x1x8")` returns 8 such devices (SLICES x HOSTS x GPUS per host); programs
jitted onto them lower and compile (XLA fusions, Pallas Triton and Mosaic GPU kernels, for
sm_90a), `memory_analysis()` reports their buffers, and they cannot run.

Needs the CUDA plugin (`pip install 'jaxserve[gpu]'`, i.e. jax[cuda12]) and, on a machine without
an NVIDIA GPU, JAX_PLATFORMS=cpu set before JAX starts: the plugin otherwise checks the CUDA driver
(cuInit) when it loads, fails, and is not registered. What a compile-only target does not do:
`cost_analysis()` is None, device memory is not checked at compile time (an oversized program
compiles), and matmuls are not autotuned (XLA picks its default configurations).

The figures below are the cards' published numbers. Sources, cited by tag next to each figure:
  [DS-H100]  NVIDIA H100 Tensor Core GPU data sheet, "H100 SXM" column.
  [DS-H200]  NVIDIA H200 Tensor Core GPU data sheet, "H200 SXM" column.
  [WP]       NVIDIA H100 Tensor Core GPU Architecture white paper (GH100 / H100 SXM5 tables; the
             H200 is the same GH100 configuration with HBM3e).
  [CUDA-CC]  CUDA C++ Programming Guide, "Compute Capabilities": the technical specifications
             table, compute capability 9.0 column.
  [HTG]      NVIDIA Hopper Tuning Guide, "Unified Shared Memory/L1/Texture Cache".
  [CUDA-GPUS] NVIDIA's "CUDA GPUs - Compute Capability" list (H100, H200: 9.0).
"""
from __future__ import annotations

import functools
import importlib.util
import re

import jax

KIB = 1024
MIB = 1024 ** 2
GIB = 1024 ** 3
GB = 10 ** 9

# What every compute capability 9.0 part has [CUDA-CC], unless noted.
_SM90: dict[str, int | tuple[int, int]] = {
    "compute_capability": (9, 0),               # [CUDA-GPUS]
    "warp_size": 32,                            # [CUDA-CC] warp size
    "max_threads_per_block": 1024,              # [CUDA-CC] maximum number of threads per block
    "max_threads_per_sm": 2048,                 # [CUDA-CC] maximum number of resident threads per SM
    "max_grid_x": 2 ** 31 - 1,                  # [CUDA-CC] maximum x-dimension of a grid of thread blocks
    "max_grid_yz": 65535,                       # [CUDA-CC] maximum y- or z-dimension of a grid
    "registers_per_sm": 64 * 1024,              # [CUDA-CC] number of 32-bit registers per SM
    "registers_per_block": 64 * 1024,           # [CUDA-CC] maximum number of 32-bit registers per block
    "shared_memory_per_sm": 228 * KIB,          # [CUDA-CC], [HTG] maximum shared memory per SM: 228 KB
    "shared_memory_per_block_optin": 227 * KIB,  # [CUDA-CC], [HTG] maximum per thread block: 227 KB (opt-in)
    "shared_memory_per_block": 48 * KIB,        # [CUDA-CC] per block without opting in (static shared memory)
}

# Per card: the data-sheet figures (and the GH100 configuration from the white paper).
GPU_SPECS: dict[str, dict[str, int | float | str | tuple[int, int]]] = {
    "h100": {
        **_SM90,
        "device_kind": "NVIDIA H100 80GB HBM3",  # the name CUDA reports for the H100 SXM5 80 GB
        "sm_count": 132,                        # [WP] H100 SXM5: 132 SMs
        "fp32_cores_per_sm": 128,               # [WP] 128 FP32 CUDA cores per SM
        # [DS-H100] FP32 67 TFLOPS = 132 SMs x 128 cores x 2 (FMA) x clock -> 1.98 GHz boost clock
        "clock_ghz": 1.98,
        "l2_cache_bytes": 50 * MIB,             # [WP] H100 SXM5: 50 MB L2 cache
        "memory_bytes": 80 * GIB,               # [DS-H100] GPU memory: 80GB (HBM3)
        "memory_bandwidth": 3350 * GB,          # [DS-H100] GPU memory bandwidth: 3.35TB/s
    },
    "h200": {
        **_SM90,
        "device_kind": "NVIDIA H200",           # the name CUDA reports for the H200 SXM 141 GB
        "sm_count": 132,                        # [WP] GH100 as in the H100 SXM5: 132 SMs
        "fp32_cores_per_sm": 128,               # [WP] 128 FP32 CUDA cores per SM
        "clock_ghz": 1.98,                      # [DS-H200] FP32 67 TFLOPS, as the H100 SXM: 1.98 GHz
        "l2_cache_bytes": 50 * MIB,             # [WP] GH100 (H100 SXM5 configuration): 50 MB L2
        "memory_bytes": 141 * GB,               # [DS-H200] GPU memory: 141GB (HBM3e)
        "memory_bandwidth": 4800 * GB,          # [DS-H200] GPU memory bandwidth: 4.8TB/s
    },
}
CHIPS = tuple(GPU_SPECS)

# Software the target claims (not hardware figures): the CUDA 12 runtime release that
# jax[cuda12]==0.10.2 installs (nvidia-cuda-runtime-cu12 12.9) and the lowest cuDNN its CUDA plugin
# accepts (nvidia-cudnn-cu12 >= 9.8).
CUDA_RUNTIME_VERSION = (12, 9, 0)
CUDNN_VERSION = (9, 8, 0)

_TOPOLOGY = re.compile(r"(\d+)x(\d+)x(\d+)")
# The CUDA plugins jax[cudaNN] installs register themselves under these module names.
_CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
INSTALL_HINT = "pip install 'jaxserve[gpu]' (jax[cuda12]==0.10.2)"


class GpuTargetUnavailable(ImportError):
    """The CUDA plugin is not installed or not loaded; the message says what to do (an ImportError,
    like targets.TargetUnavailable: a missing compiler plugin, reported by the CLI without a traceback)."""


def _chip_spec(chip: str) -> dict:
    spec = GPU_SPECS.get(chip)
    if spec is None:
        raise ValueError(f"unknown GPU chip {chip!r}; valid chips: {', '.join(CHIPS)}")
    return spec


def target_config(chip: str) -> str:
    """The text-format GpuTargetConfigProto describing `chip` ("h100" | "h200")."""
    s = _chip_spec(chip)
    major, minor = s["compute_capability"]
    rt, dnn = CUDA_RUNTIME_VERSION, CUDNN_VERSION
    return "\n".join([
        "gpu_device_info {",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        f"  threads_per_block_limit: {s['max_threads_per_block']}",
        f"  threads_per_warp: {s['warp_size']}",
        f"  shared_memory_per_block: {s['shared_memory_per_block']}",
        f"  shared_memory_per_block_optin: {s['shared_memory_per_block_optin']}",
        f"  shared_memory_per_core: {s['shared_memory_per_sm']}",
        f"  threads_per_core_limit: {s['max_threads_per_sm']}",
        f"  core_count: {s['sm_count']}",
        f"  fpus_per_core: {s['fp32_cores_per_sm']}",
        f"  block_dim_limit_x: {s['max_grid_x']}",
        f"  block_dim_limit_y: {s['max_grid_yz']}",
        f"  block_dim_limit_z: {s['max_grid_yz']}",
        f"  memory_bandwidth: {s['memory_bandwidth']}",
        f"  l2_cache_size: {s['l2_cache_bytes']}",
        f"  clock_rate_ghz: {s['clock_ghz']}",
        f"  device_memory_size: {s['memory_bytes']}",
        f"  registers_per_core_limit: {s['registers_per_sm']}",
        f"  registers_per_block_limit: {s['registers_per_block']}",
        "}",
        'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
        f"runtime_version {{ major: {rt[0]} minor: {rt[1]} patch: {rt[2]} }}",
        # The device kind jax reports is this string.
        f'device_description_str: "{s["device_kind"]}"',
        "",
    ])


def parse_topology(topology: str) -> tuple[int, int, int]:
    """'SLICESxHOSTSxGPUS' (e.g. '1x1x8') -> (slices, hosts per slice, GPUs per host)."""
    m = _TOPOLOGY.fullmatch(topology.strip()) if isinstance(topology, str) else None
    if m is None or any(int(d) < 1 for d in m.groups()):
        raise ValueError(
            f"GPU topology must be SLICESxHOSTSxGPUS with positive counts (e.g. '1x1x8': one "
            f"host of 8 GPUs), got {topology!r}"
        )
    return tuple(int(d) for d in m.groups())  # type: ignore[return-value]


def cuda_plugin_installed() -> bool:
    """Whether a jax CUDA plugin package is importable (it is not imported here)."""
    for name in _CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # the jax_plugins namespace itself is absent
            pass
    return False


@functools.lru_cache(maxsize=None)
def _devices(chip: str, topology: str) -> tuple[jax.Device, ...]:
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            "", "cuda", target_config=target_config(chip), topology=topology)
    except NotImplementedError as e:  # the plugin is installed but did not register itself
        raise GpuTargetUnavailable(
            f"the CUDA plugin is installed but not loaded ({e}). On a machine without an NVIDIA "
            f"GPU set JAX_PLATFORMS=cpu before JAX starts (the plugin otherwise fails at cuInit "
            f"and is skipped); elsewhere check the jax[cuda12] install ({INSTALL_HINT})"
        ) from None
    return tuple(desc.devices)


def gpu_devices(chip: str, topology: str) -> list[jax.Device]:
    """Compile-only devices of `chip` ("h100" | "h200") laid out as `topology` ("SLICESxHOSTSxGPUS",
    e.g. "1x1x8"). The same arguments give the same device objects. Raises ValueError for an unknown
    chip or a malformed topology, GpuTargetUnavailable (an ImportError) without the CUDA plugin."""
    if not isinstance(chip, str):
        raise ValueError(f"unknown GPU chip {chip!r}; valid chips: {', '.join(CHIPS)}")
    chip = chip.strip().lower()
    _chip_spec(chip)
    slices, hosts, gpus = parse_topology(topology)
    if not cuda_plugin_installed():
        raise GpuTargetUnavailable(
            f"compiling for an NVIDIA GPU ({chip}) needs JAX's CUDA plugin, which is not "
            f"installed: {INSTALL_HINT}"
        )
    return list(_devices(chip, f"{slices}x{hosts}x{gpus}"))
