"""Deployment targets: a chip and a topology (`tpu-v6e:2x2`, `gpu-h200:1x1x8`, `cpu`), the
compile-only devices XLA gives for it on any machine, and the chip's published figures.

XLA compiles for devices it does not have: libtpu describes any TPU slice
(`jax.experimental.topologies.get_topology_desc`), the CUDA plugin any GPU given a target
description (gpu_target.py). Programs lowered on those devices compile with the target's own
compiler (Mosaic kernels included) and report `memory_analysis()`; they cannot run.

The figures in `CHIPS` are the vendors' published per-chip numbers (docs/PLANNING.md lists each
source): dense peak FLOP/s per dtype, HBM capacity and bandwidth, and the chip's interconnect
bandwidth (ICI or NVLink, bidirectional). A CPU target's figures come from this machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Mapping

import jax

from jaxserve.core.quiet import quiet_libtpu

GB = 10 ** 9
GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                        # "v6e", "h100", "cpu"
    platform: str                    # "tpu" | "gpu" | "cpu"
    device_kind: str                 # as jax reports it
    hbm_bytes: int                   # memory per device
    hbm_bandwidth: float             # bytes/s per device
    peak_flops: Mapping[str, float]  # dense FLOP/s per operand dtype ("bfloat16", "float8", "int8", "float32")
    link_bandwidth: float            # bytes/s per chip, bidirectional (ICI / NVLink); 0 = none
    source: str                      # where the figures come from

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype` (a dtype without its own figure runs at the bf16 rate
        on TPU, where f32 matmuls are emulated in bf16 passes, and at the f32 rate elsewhere)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if self.platform == "tpu" and dtype == "float32":
            return self.peak_flops["bfloat16"] / 3  # f32 contract precision: 3 bf16 passes (bf16_3x)
        return self.peak_flops.get("float32", self.peak_flops["bfloat16"])


# Published per-chip figures; sources in docs/PLANNING.md ("Chip table").
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "tpu", "TPU v5 lite", 16 * GIB, 819 * GB, {"bfloat16": 197e12, "int8": 394e12},
                400 * GB, "cloud.google.com/tpu/docs/v5e"),
    "v6e": Chip("v6e", "tpu", "TPU v6 lite", 32 * GIB, 1640 * GB, {"bfloat16": 918e12, "int8": 1836e12},
                800 * GB, "cloud.google.com/tpu/docs/v6e"),
    "v5p": Chip("v5p", "tpu", "TPU v5", 95 * GIB, 2765 * GB,
                {"bfloat16": 459e12, "float8": 459e12, "int8": 918e12}, 1200 * GB, "cloud.google.com/tpu/docs/v5p"),
    "h100": Chip("h100", "gpu", "NVIDIA H100 80GB HBM3", 80 * GIB, 3350 * GB,
                 {"bfloat16": 989e12, "float8": 1979e12, "int8": 1979e12, "float32": 67e12}, 900 * GB,
                 "nvidia.com/en-us/data-center/h100 (SXM, dense)"),
    "h200": Chip("h200", "gpu", "NVIDIA H200", 141 * GB, 4800 * GB,
                 {"bfloat16": 989e12, "float8": 1979e12, "int8": 1979e12, "float32": 67e12}, 900 * GB,
                 "nvidia.com/en-us/data-center/h200 (SXM, dense)"),
}
# Names a user may write for a chip.
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e", "v6": "v6e"}
# libtpu's topology names
_TPU_TOPOLOGY_NAME = {"v5e": "v5e", "v6e": "v6e", "v5p": "v5p"}
# Chips one host carries, by TPU generation: v5e/v6e slices up to 8 chips are one host (2x4),
# larger ones hosts of 2x2; v5p hosts carry 2x2x1.
_TPU_HOST_CHIPS = {"v5e": 8, "v6e": 8, "v5p": 4}


class TargetUnavailable(ImportError):
    """The compiler plugin for a target is not installed (the message names the extra)."""


@dataclasses.dataclass(frozen=True)
class Target:
    chip: Chip
    topology: tuple[int, ...]        # TPU: chip grid (x, y[, z]); GPU: (slices, hosts, GPUs per host); CPU: (devices,)

    @property
    def name(self) -> str:
        if self.chip.platform == "cpu":
            return f"cpu:{self.num_devices}"
        return f"{self.chip.platform}-{self.chip.name}:{'x'.join(map(str, self.topology))}"

    @property
    def num_devices(self) -> int:
        n = 1
        for d in self.topology:
            n *= d
        return n

    def devices(self) -> list[jax.Device]:
        """The target's devices: compile-only for TPU/GPU, this process's CPU devices for cpu."""
        if self.chip.platform == "cpu":
            devices = jax.devices("cpu")
            if len(devices) < self.num_devices:
                raise ValueError(f"target {self.name} needs {self.num_devices} CPU devices, this process has "
                                 f"{len(devices)} (XLA_FLAGS=--xla_force_host_platform_device_count=N)")
            return devices[: self.num_devices]
        if self.chip.platform == "gpu":
            from jaxserve.planning.gpu_target import gpu_devices
            return gpu_devices(self.chip.name, "x".join(map(str, self.topology)))
        return _tpu_devices(self.chip.name, self.topology)


def target_names() -> list[str]:
    """Examples of every valid target form, for error messages and --help."""
    tpu = [f"tpu-{c}:2x2" for c, chip in CHIPS.items() if chip.platform == "tpu"]
    gpu = [f"gpu-{c}:1x1x8" for c, chip in CHIPS.items() if chip.platform == "gpu"]
    return tpu + gpu + ["cpu", "cpu:8"]


def parse_target(text: str) -> Target:
    """'tpu-v6e:2x2' | 'tpu-v5p:2x2x1' | 'gpu-h100:1x1x8' | 'cpu' | 'cpu:8' -> Target."""
    raw = text.strip().lower()
    valid = ", ".join(target_names())
    if raw == "cpu" or raw.startswith("cpu:"):
        count = raw.partition(":")[2] or "1"
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"bad CPU target {text!r}: write cpu or cpu:N (valid targets: {valid})")
        return Target(cpu_chip(), (int(count),))
    m = re.fullmatch(r"(tpu|gpu)-([a-z0-9]+):(\d+(?:x\d+)*)", raw)
    if m is None:
        raise ValueError(f"unknown target {text!r}; valid targets look like: {valid}")
    platform, chip_name, shape = m.groups()
    chip_name = _ALIASES.get(chip_name, chip_name)
    chip = CHIPS.get(chip_name)
    if chip is None or chip.platform != platform:
        known = ", ".join(c for c, ch in CHIPS.items() if ch.platform == platform)
        raise ValueError(f"unknown {platform.upper()} chip {m.group(2)!r} in {text!r}; known: {known} "
                         f"(valid targets look like: {valid})")
    topology = tuple(int(d) for d in shape.split("x"))
    if any(d < 1 for d in topology):
        raise ValueError(f"topology {shape!r} of {text!r} has an empty dimension")
    if platform == "gpu" and len(topology) != 3:
        raise ValueError(f"GPU topology must be SLICESxHOSTSxGPUS (e.g. 1x1x8), got {shape!r}")
    if platform == "tpu" and len(topology) not in (2, 3):
        raise ValueError(f"TPU topology must be XxY or XxYxZ chips (e.g. 2x2, 2x2x1), got {shape!r}")
    if chip_name == "v5p" and len(topology) != 3:
        raise ValueError(f"v5p slices are 3-D (e.g. 2x2x1), got {shape!r}")
    return Target(chip, topology)


def cpu_chip() -> Chip:
    """This machine as a target: RAM available now, the nominal f32 rate of its cores (capacity.py)
    and a nominal DRAM bandwidth (not measured: the roofline of a CPU plan is indicative)."""
    from jaxserve.core.capacity import CPU_FLOPS_PER_CORE
    from jaxserve.runner.machine import available_ram, cpu_cores, cpu_isa, cpu_model_name

    cores = cpu_cores()
    rate = CPU_FLOPS_PER_CORE[cpu_isa()] * cores
    return Chip("cpu", "cpu", cpu_model_name(), available_ram(), CPU_DRAM_BANDWIDTH,
                {"float32": rate, "bfloat16": rate}, 0.0, f"this machine ({cores} cores, {cpu_isa()})")


CPU_DRAM_BANDWIDTH = 20 * GB  # nominal two-channel DDR4/5 share of a small VM


def _tpu_devices(chip: str, topology: tuple[int, ...]) -> list[jax.Device]:
    if importlib.util.find_spec("libtpu") is None:
        raise TargetUnavailable("compiling for a TPU needs libtpu: pip install 'jaxserve[tpu]' "
                                "(or the test extra, which includes it)")
    from jax.experimental import topologies

    quiet_libtpu()
    dims = list(topology) + [1] * (3 - len(topology))
    chips = dims[0] * dims[1] * dims[2]
    if chips <= _TPU_HOST_CHIPS[chip]:
        bounds = dims                      # one host holds the whole slice
    else:
        bounds = [min(dims[0], 2), min(dims[1], 2), 1]
    name = f"{_TPU_TOPOLOGY_NAME[chip]}:{'x'.join(map(str, topology))}"
    try:
        return list(topologies.get_topology_desc(name, "tpu", chips_per_host_bounds=bounds).devices)
    except Exception as e:  # libtpu's messages are terse: add what was asked
        raise ValueError(f"libtpu rejects TPU topology {name!r} (hosts of {'x'.join(map(str, bounds))} chips): "
                         f"{str(e).splitlines()[0]}") from None
