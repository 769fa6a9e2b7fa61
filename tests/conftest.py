"""Test-wide settings: 8 fake CPU devices for sharding tests, no downloads, float32 matmuls."""
import os
import sys

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jaxserve.quiet import quiet_libtpu  # noqa: E402

quiet_libtpu()  # compile-only TPU targets (libtpu is in the test extra): no metadata queries, no lock file

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")




# The persistent XLA compilation cache stays out of the shared test workers: writing an executable
# to it has crashed a worker (segfault in jax's compilation_cache.put_executable_and_time, seen here
# and, the same way, on CI), and an engine loaded in-process with the default directory would leave
# it on for every later test of that worker. In-process engines use it only when a test names a
# directory (tests/server/conftest.py's loaded_model does, and turns it off again); servers started
# as subprocesses keep the default.
import jaxserve.llm as _llm  # noqa: E402

_enable_compilation_cache = _llm.enable_compilation_cache


def _named_directory_only(directory):
    return None if directory is None else _enable_compilation_cache(directory)


_llm.enable_compilation_cache = _named_directory_only


def pytest_runtest_teardown(item):
    """tokamax stays out of the shared workers (tests/own_process.py says why), and so does the
    persistent compilation cache (above)."""
    if "tokamax" in sys.modules and os.environ.get("JAXSERVE_TEST_OWN_PROCESS") != "1":
        raise AssertionError(f"{item.nodeid} imported tokamax into a shared test worker: decorate it with "
                             "own_process.in_own_process")
    if jax.config.jax_compilation_cache_dir is not None:
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
