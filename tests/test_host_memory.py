"""The package's malloc settings (jaxserve/core/host_memory.py): a large freed buffer stays in the
process's heap for the next allocation instead of going back to the kernel (to be faulted in again,
page by page, the next time: what a CPU step did every step)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os, jaxserve, numpy as np
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
base = rss()
a = np.ones(16 * 1024 * 1024, np.float32)  # 64 MiB: above glibc's largest mmap threshold
del a
print(rss() - base)
"""


def _kept_bytes(tuning: str) -> int:
    """Resident bytes a 64 MiB buffer leaves behind once freed."""
    env = {**os.environ, "JAXSERVE_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


def test_freed_large_buffers_stay_in_the_heap():
    assert _kept_bytes("0") < 8 * 1024 * 1024       # glibc alone: unmapped on free
    assert _kept_bytes("1") > 60 * 1024 * 1024      # tuned: kept for the next step's buffers


def test_tuning_applies_on_glibc_and_can_be_turned_off(monkeypatch):
    from jaxserve.core.host_memory import tune_malloc

    assert tune_malloc()  # these machines run glibc on Linux
    monkeypatch.setenv("JAXSERVE_MALLOC_TUNING", "0")
    assert not tune_malloc()
