"""Test-wide settings: 8 fake CPU devices for sharding tests, no downloads, float32 matmuls, one
persistent compilation cache for the whole run."""
import collections
import gc
import os
import sys
from pathlib import Path

# Must happen before jax is imported anywhere. The suite's time is ~2/3 XLA:CPU compiles of tiny
# programs (a 2-layer forward is ~200 fusions). Two flags halve a tiny engine's warm-up (19-21 s of
# CPU -> 8.7-9.5 s, Xeon Sapphire Rapids): XLA:CPU's older elemental fusion emitter instead of the
# MLIR fusion emitters (most of the time per fusion is the MLIR pipeline), and LLVM at -O0. The
# models are too small for code speed to matter (a softmax over [64, 151,936]: 68 ms at XLA's own
# flags, 138 ms at these), except to structured/test_validity, which generates its samples in a
# child process at XLA's own flags. No fast math at either level.
# Compile-only TPU targets ignore both flags; subprocesses inherit them. jaxlib 0.11's XLA no longer
# has the emitter flag (an unknown flag aborts the process): there the MLIR emitters stay.


def _jaxlib_before(major: int, minor: int) -> bool:
    from importlib.metadata import version  # jax itself must not be imported before XLA_FLAGS is set

    return tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (major, minor)


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
                      + (" --xla_cpu_use_fusion_emitters=false" if _jaxlib_before(0, 11) else ""))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jaxserve.core.quiet import quiet_libtpu  # noqa: E402

quiet_libtpu()  # compile-only TPU targets (libtpu is in the test extra): no metadata queries, no lock file

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jaxserve.engine.loading import enable_compilation_cache  # noqa: E402

# The user's cache dir, as `jaxserve serve` and LLM() use it: a program another test (or a server
# subprocess) compiled is loaded instead of compiled again; a whole run with it took 0.9x the time.
enable_compilation_cache(None)

import pytest  # noqa: E402

from jaxserve.runner import model_runner  # noqa: E402
from jaxserve.runner.model_runner import ModelRunner  # noqa: E402

# Runners keep their programs in memory only here: the on-disk program store pins every program it
# loads or stores for the life of the process (program_store.py says why), which would defeat the
# memory-map budget below. tests/test_program_store.py turns it on with directories of its own, and
# servers started as subprocesses use it as users get it.
model_runner.cache_directory = lambda: None


def _memory_maps() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def _max_memory_maps() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 0  # not Linux: no limit to watch


# Every compiled XLA:CPU program holds a few memory maps (its JIT-linked code and data sections)
# for as long as jax caches it, and an xdist worker compiles thousands of programs over the suite
# (tests/speculative/test_eagle3.py alone adds ~19,000 maps). At vm.max_map_count (65,530 by default)
# mmap fails inside LLVM's JIT linker or jax's executable serializer, and the worker dies of SIGABRT
# or SIGSEGV in some later test's compile: the late-suite worker crash seen on CI and here (the core
# of one held 65,531 maps). Past half the limit (so the largest file still fits above it), a worker
# drops every compiled program between test files, then warms up again the engines still alive
# (session fixtures), so their "no compilation after warm-up" assertions keep meaning what they
# say. Each drop costs 5-50 s of recompiling: at a quarter of the limit a run made 7 (~1,300 s).
_MAPS_BUDGET = _max_memory_maps() // 2


@pytest.fixture(scope="module", autouse=True)
def _memory_map_budget():
    yield  # autouse: set up first, so torn down after the module's own fixtures (its servers stopped)
    if _MAPS_BUDGET and _memory_maps() > _MAPS_BUDGET:
        runners = [o for o in gc.get_objects() if type(o) is ModelRunner]
        for runner in runners:  # their AOT programs (program_store.py) hold maps of their own
            runner.programs.clear()
        jax.clear_caches()
        gc.collect()
        for runner in [r for r in runners if r.warmed_up]:
            runner.warmed_up = False
            runner.warmup()


def pytest_runtest_teardown(item):
    """tokamax stays out of the shared workers (tests/own_process.py says why)."""
    if "tokamax" in sys.modules and os.environ.get("JAXSERVE_TEST_OWN_PROCESS") != "1":
        raise AssertionError(f"{item.nodeid} imported tokamax into a shared test worker: decorate it with "
                             "own_process.in_own_process")


# The files that take a minute or more, heaviest first (seconds per file in a CI run on AMD EPYC,
# 2 workers): scheduled before everything else, so the run ends on small files and neither worker
# idles for long while the other finishes a big one. xdist's own order (most tests first, turned off
# in pyproject) put the slow files of few tests last: the README's, 6 tests and 9 minutes, came 70th
# of 102, the device check 74th. The rest keep that order; a file missing here only runs later.
HEAVY_FIRST = (
    "tests/test_target_compile.py",             # 410
    "tests/test_readme_plan.py",                # 360
    "tests/test_device_check.py",               # 330
    "tests/test_plan.py",                       # 260
    "tests/structured/test_validity.py",        # 220
    "tests/test_readme.py",                     # 190
    "tests/model/test_family_targets.py",       # 130
    "tests/structured/test_structured_engine.py",  # 125
    "tests/test_program_store.py",              # 115
    "tests/test_multihost.py",                  # 95
    "tests/quant/test_kv_cache_quant.py",       # 80
    "tests/kernels/test_rpa_tiled_compile.py",  # 80
    "tests/test_router.py",                     # 75
    "tests/server/test_server_lifecycle.py",    # 75
    "tests/quant/test_reference_packers.py",    # 65
    "tests/server/test_spec_server.py",         # 55, one test
    "tests/test_kv_duplication.py",             # 50
    "tests/structured/test_structured_families.py",  # 45
    "tests/test_runtime_dependencies.py",       # 40
)


def pytest_collection_modifyitems(config, items):
    """HEAVY_FIRST's files first, then the rest with the most tests first (xdist's own order); a
    file's tests keep their order. The same order in every worker (xdist checks)."""
    file_of = {item: item.nodeid.split("::")[0] for item in items}
    counts = collections.Counter(file_of.values())
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    # stable: a file's tests stay in collection order; ties between files by path
    items.sort(key=lambda item: (rank.get(file_of[item], len(rank)), -counts[file_of[item]], file_of[item]))
