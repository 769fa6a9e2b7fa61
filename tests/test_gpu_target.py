"""jaxserve.planning.gpu_target without the CUDA plugin: the figures behind the H100/H200 target
descriptions, the text protos built from them, and the errors `gpu_devices` gives.

The compile-only devices themselves are exercised by the `gpu_compile` tests
(tests/kernels/test_rpa_gpu_compile.py), which need the gpu extra."""
import ast
import os
import re
import subprocess
import sys

import pytest

from jaxserve.planning import gpu_target
from jaxserve.planning.gpu_target import GIB, GB, KIB, MIB


def test_figures_are_the_data_sheet_numbers():
    h100, h200 = gpu_target.GPU_SPECS["h100"], gpu_target.GPU_SPECS["h200"]
    for spec in (h100, h200):
        assert spec["compute_capability"] == (9, 0)
        assert spec["sm_count"] == 132
        assert spec["fp32_cores_per_sm"] == 128
        assert spec["shared_memory_per_sm"] == 228 * KIB
        assert spec["shared_memory_per_block_optin"] == 227 * KIB
        assert spec["shared_memory_per_block"] == 48 * KIB
        assert spec["registers_per_sm"] == spec["registers_per_block"] == 65536
        assert spec["max_threads_per_sm"] == 2048 and spec["max_threads_per_block"] == 1024
        assert spec["warp_size"] == 32
        assert spec["l2_cache_bytes"] == 50 * MIB
        # The data sheets' FP32 rate: SMs x cores x 2 FLOP (FMA) x clock = 67 TFLOPS.
        fp32 = spec["sm_count"] * spec["fp32_cores_per_sm"] * 2 * spec["clock_ghz"] * 1e9
        assert fp32 == pytest.approx(67e12, rel=0.005)
    assert h100["memory_bytes"] == 80 * GIB and h100["memory_bandwidth"] == 3350 * GB
    assert h200["memory_bytes"] == 141 * GB and h200["memory_bandwidth"] == 4800 * GB
    assert h100["device_kind"] == "NVIDIA H100 80GB HBM3" and h200["device_kind"] == "NVIDIA H200"
    assert gpu_target.CHIPS == ("h100", "h200")


def _fields(proto: str) -> dict[str, str]:
    return dict(re.findall(r"^\s*(\w+): (\S+)$", proto, re.M))


@pytest.mark.parametrize("chip", gpu_target.CHIPS)
def test_target_config_carries_the_figures(chip):
    spec = gpu_target.GPU_SPECS[chip]
    proto = gpu_target.target_config(chip)
    fields = _fields(proto)
    assert proto.startswith("gpu_device_info {") and proto.count("{") == proto.count("}")
    assert "cuda_compute_capability { major: 9 minor: 0 }" in proto
    assert fields["core_count"] == str(spec["sm_count"])
    assert fields["fpus_per_core"] == str(spec["fp32_cores_per_sm"])
    assert fields["shared_memory_per_block_optin"] == str(227 * 1024)
    assert fields["shared_memory_per_core"] == str(228 * 1024)
    assert fields["shared_memory_per_block"] == str(48 * 1024)
    assert fields["memory_bandwidth"] == str(spec["memory_bandwidth"])
    assert fields["device_memory_size"] == str(spec["memory_bytes"])
    assert fields["l2_cache_size"] == str(spec["l2_cache_bytes"])
    assert float(fields["clock_rate_ghz"]) == spec["clock_ghz"]
    assert fields["platform_name"] == '"CUDA"'
    assert f'device_description_str: "{spec["device_kind"]}"' in proto
    # This jaxlib's parser rejects the newer field; it must never be emitted.
    assert "collective_memory_granularity" not in proto


def test_topology_parsing():
    assert gpu_target.parse_topology("1x1x8") == (1, 1, 8)
    assert gpu_target.parse_topology(" 2x4x8 ") == (2, 4, 8)
    for bad in ("8", "1x8", "1x1x0", "0x1x1", "1x1x8x1", "axbxc", "1x1x-2", "", None):
        with pytest.raises(ValueError, match="SLICESxHOSTSxGPUS"):
            gpu_target.parse_topology(bad)


def test_gpu_devices_rejects_unknown_chip_and_bad_topology():
    with pytest.raises(ValueError, match=r"unknown GPU chip 'a100'; valid chips: h100, h200"):
        gpu_target.gpu_devices("a100", "1x1x8")
    with pytest.raises(ValueError, match="valid chips: h100, h200"):
        gpu_target.target_config("b200")
    with pytest.raises(ValueError, match="SLICESxHOSTSxGPUS"):
        gpu_target.gpu_devices("h100", "8")
    with pytest.raises(ValueError, match="SLICESxHOSTSxGPUS"):
        gpu_target.gpu_devices("h200", "1x0x8")


def test_gpu_devices_without_the_cuda_plugin_names_the_extra(monkeypatch):
    # Runs in every environment: where the plugin is installed, pretend it is not.
    monkeypatch.setattr(gpu_target, "cuda_plugin_installed", lambda: False)
    with pytest.raises(ImportError, match=re.escape("pip install 'jaxserve[gpu]'")) as info:
        gpu_target.gpu_devices("h100", "1x1x8")
    assert isinstance(info.value, gpu_target.GpuTargetUnavailable)
    assert "jax[cuda12]" in str(info.value)


def test_module_imports_only_jax_numpy_and_the_standard_library():
    """Importing gpu_target loads nothing beyond jax and the standard library (no CUDA plugin, no
    other jaxserve module), so it imports cleanly in an environment without the gpu extra."""
    code = (
        "import sys\n"
        "import jax\n"
        "after_jax = set(sys.modules)\n"
        "import jaxserve.planning.gpu_target\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - after_jax}\n"
        "print(sorted(new - {'jaxserve'} - set(sys.stdlib_module_names)))\n"
        "print(sorted(m for m in sys.modules if m.startswith('jaxserve')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout.split("\n")
    assert out[0] == "[]", out
    # jaxserve.core.host_memory is the package's own import-time setting (standard library only)
    assert sorted(ast.literal_eval(out[1])) == ["jaxserve", "jaxserve.core", "jaxserve.core.host_memory", "jaxserve.planning",
                                    "jaxserve.planning.gpu_target"], out
