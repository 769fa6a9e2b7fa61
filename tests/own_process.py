"""Running test code in a fresh interpreter: the environment a child process gets, and a decorator
for tests that must not share an interpreter with the rest of the suite."""

import functools
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (the package imports when
    the suite runs from a source tree, not only from an install), plus `overrides`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **overrides}


def in_own_process(test):
    """Runs `test` in a fresh interpreter (a pytest of its own node id) and fails with its output.

    For tests that import tokamax: its import loads jaxlib's GPU Mosaic and Triton extensions and
    marks absl's flags parsed, process-wide; the shared workers stay the CPU process a user runs.
    (The late-suite worker crashes once blamed on it were the memory-map limit: tests/conftest.py.)"""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("JAXSERVE_TEST_OWN_PROCESS") == "1":
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]  # "path::name[params] (call)"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", node],
                              cwd=REPO, env={**os.environ, "JAXSERVE_TEST_OWN_PROCESS": "1"},
                              capture_output=True, text=True, timeout=900)
        output = f"{node} in its own process:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
        assert done.returncode == 0 and "1 passed" in done.stdout, output

    return run
