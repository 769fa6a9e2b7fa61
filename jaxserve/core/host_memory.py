"""glibc malloc settings for a process that runs XLA on the CPU.

A CPU step allocates and frees buffers of tens of MB every step (a [64, 151,936] float32 logits
array is 39 MB). glibc serves anything above its mmap threshold (at most 32 MB) with a fresh
mmap and gives it back on free, and trims its thread arenas' heaps, so each step faulted in
~190 MB of new zero pages: on a 2-core machine half the step time was system time (page faults).
One arena, no mmap-served chunks and a 1 GiB trim threshold keep freed buffers in the heap for
the next step. Applied once at import of the package, before jax creates its threads (a thread
keeps the arena it first allocated from). `JAXSERVE_MALLOC_TUNING=0` turns it off; a libc
without `mallopt` (musl, macOS) is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 1 << 30


def tune_malloc() -> bool:
    """Applies the settings; True if glibc took all of them."""
    if os.environ.get("JAXSERVE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
