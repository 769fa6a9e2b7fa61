"""Test-wide settings: 8 fake CPU devices for sharding tests, no downloads, float32 matmuls."""
import os
import sys

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Workers live for the whole suite and compile thousands of programs; with host_memory.py's malloc
# settings (one arena, no mmap-served chunks: every allocation from one brk heap) two late-suite
# workers died of segmentation faults inside XLA's compiler (here and on CI). The suite runs with
# glibc's defaults until that is understood; the settings stay on for `jaxserve serve`.
os.environ.setdefault("JAXSERVE_MALLOC_TUNING", "0")

from jaxserve.quiet import quiet_libtpu  # noqa: E402

quiet_libtpu()  # compile-only TPU targets (libtpu is in the test extra): no metadata queries, no lock file

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_runtest_teardown(item):
    """tokamax stays out of the shared workers (tests/own_process.py says why)."""
    if "tokamax" in sys.modules and os.environ.get("JAXSERVE_TEST_OWN_PROCESS") != "1":
        raise AssertionError(f"{item.nodeid} imported tokamax into a shared test worker: decorate it with "
                             "own_process.in_own_process")
