"""What the capacity planner needs to know about the devices a mesh runs on (memory, cores, kind).

Accelerators report their memory limit and what is in use (weights included) through
`Device.memory_stats()`. A CPU device shares the host's RAM, so its figure is the RAM available
now (`MemAvailable`, read after the weights are loaded, so they are already accounted for).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.core.capacity import MachineInfo


def machine_info(mesh: Mesh) -> MachineInfo:
    info = _local_machine_info(mesh)
    if jax.process_count() == 1:
        return info
    # Multi-host: every process must size the same KV pool, so all take rank 0's figures (free
    # memory differs between processes), in MiB.
    from jax.experimental import multihost_utils

    mib = np.asarray([info.memory_per_device >> 20, info.memory_in_use >> 20, info.cpu_cores], np.int32)
    memory, in_use, cores = (int(v) for v in multihost_utils.broadcast_one_to_all(mib))
    return dataclasses.replace(info, memory_per_device=memory << 20, memory_in_use=in_use << 20, cpu_cores=cores)


def _local_machine_info(mesh: Mesh) -> MachineInfo:
    # this process's first device (multi-host: the others' devices report nothing here)
    here = jax.process_index()
    device = next((d for d in mesh.devices.flat if d.process_index == here), mesh.devices.flat[0])
    cores = cpu_cores()
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    if platform == "cpu":
        return MachineInfo("cpu", cpu_model_name(), available_ram(), 0, cores, cpu_isa())
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"{device.device_kind} does not report its memory; set --num-kv-pages or "
                         "--kv-cache-memory")
    return MachineInfo(platform, device.device_kind, int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)),
                       cores)


def cpu_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (bytes); elsewhere the physical pages the OS reports free."""
    value = _proc_field("/proc/meminfo", "MemAvailable")
    if value is not None:
        return int(value.split()[0]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_isa() -> str:
    """The widest f32 vector ISA the CPU reports: "avx512", "avx2" or "other"."""
    flags = set((_proc_field("/proc/cpuinfo", "flags") or "").split())
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "other"


def cpu_model_name() -> str:
    return _proc_field("/proc/cpuinfo", "model name") or "cpu"


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file (None where there is none)."""
    proc = Path(path)
    if not proc.is_file():
        return None
    for line in proc.read_text().splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None
