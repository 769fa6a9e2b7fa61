"""Kernel tests: `gpu` / `tpu` markers, skipped here when that backend is absent.

They are deselected by default (pyproject addopts); `scripts/device_check.sh` runs `-m gpu`.
"""
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rpa_cases.py

_HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a real GPU (deselected by default)")
    config.addinivalue_line("markers", "tpu: needs a real TPU (deselected by default)")


def pytest_collection_modifyitems(config, items):
    backend = jax.default_backend()
    for item in items:
        if _HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        for marker in ("gpu", "tpu"):
            if marker in item.keywords and backend != marker:
                item.add_marker(pytest.mark.skip(reason=f"needs a {marker.upper()} backend"))
