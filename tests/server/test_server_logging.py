"""jaxserve.core.quiet: each log filter drops its one known message and keeps everything else, and
the machine-dependent ones (TPU backend, CUDA plugin) only where that hardware is absent. The
filters meet real records here too: jax's backend start-up, orbax's save and restore, transformers'
tokenizer. (The real `jaxserve serve` log is checked in test_server_lifecycle.py and
tests/test_runtime_dependencies.py; the loading bar and log lines in tests/test_startup_logs.py.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from jaxserve.core import quiet
from jaxserve.core.quiet import quiet_startup
from own_process import REPO, child_env

ACCESS = '%s - "%s %s HTTP/%s" %d'  # uvicorn's access-log format
TPU_TOPOLOGY = "Unable to initialize backend 'tpu': INTERNAL: Failed to get global TPU topology."
CUDA_PLUGIN = "Jax plugin configuration error: Exception when calling %s.initialize()"


def passes(logger: str, msg: str, *args: object, level: int = logging.INFO, pathname: str = __file__) -> bool:
    quiet_startup()
    record = logging.LogRecord(logger, level, pathname, 1, msg, args, None)
    return bool(logging.getLogger(logger).filter(record))


TOKAMAX_AUTOTUNING = ("Autotuning cache miss for PallasTritonRaggedDot(config=None) on NVIDIA H200 with key "
                      "immutabledict({'lhs': BatchedShapeDtype(shape=(1024, 2880), dtype=bfloat16)})")


@pytest.fixture
def machine(monkeypatch):
    """machine(tpu=..., nvidia=...): the device files the filters look for, as on that machine."""
    def set_machine(tpu: bool = False, nvidia: bool = False) -> None:
        monkeypatch.setattr(quiet, "has_tpu_device_files", lambda: tpu)
        monkeypatch.setattr(quiet, "has_nvidia_device_files", lambda: nvidia)
    return set_machine


@pytest.mark.parametrize("logger,msg,args", [
    ("jax._src.xla_bridge", "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
     "cannot open shared object file: No such file or directory", ()),
    ("jax._src.xla_bridge", TPU_TOPOLOGY, ()),
    ("jax._src.xla_bridge", CUDA_PLUGIN, ("jax_plugins.xla_cuda12",)),
    ("transformers", "PyTorch was not found. Models won't be available and only tokenizers, configuration and "
     "file/data utilities can be used.", ()),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "GET", "/health", "1.1", 503)),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "GET", "/metrics?name=x", "1.1", 200)),
    ("uvicorn.error", "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", ("http", "127.0.0.1", 8000)),
    ("absl", TOKAMAX_AUTOTUNING, ()),  # lowering for a GPU this machine lacks (jaxserve plan --target gpu-...)
])
def test_known_noise_is_dropped_on_a_machine_without_tpus_or_gpus(machine, logger, msg, args):
    machine(tpu=False, nvidia=False)
    assert not passes(logger, msg, *args)


@pytest.mark.parametrize("logger,msg,args", [
    # libtpu is installed but fails: a real problem on a TPU machine
    ("jax._src.xla_bridge", "Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by pid 7", ()),
    ("jax._src.xla_bridge", TPU_TOPOLOGY, ()),
    # the CUDA plugin fails where an NVIDIA device is attached: a real problem
    ("jax._src.xla_bridge", CUDA_PLUGIN, ("jax_plugins.xla_cuda12",)),
    ("jax._src.xla_bridge", "Unable to initialize backend 'cuda': no CUDA devices", ()),
    ("transformers", "Token indices sequence length is longer than the specified maximum", ()),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "POST", "/v1/completions", "1.1", 200)),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "GET", "/healthz", "1.1", 404)),
    ("uvicorn.error", "Started server process [%d]", (42,)),
    ("uvicorn.error", "Cancel %s running task(s), timeout graceful shutdown exceeded", (1,)),
    ("absl", TOKAMAX_AUTOTUNING, ()),  # on a GPU: tuning could have happened
])
def test_everything_else_is_kept_on_a_machine_with_tpus_and_gpus(machine, logger, msg, args):
    machine(tpu=True, nvidia=True)
    assert passes(logger, msg, *args)


def test_only_the_missing_hardwares_messages_are_dropped(machine):
    machine(tpu=True, nvidia=False)
    assert passes("jax._src.xla_bridge", TPU_TOPOLOGY) and not passes("jax._src.xla_bridge", CUDA_PLUGIN,
                                                                      "jax_plugins.xla_cuda12")
    machine(tpu=False, nvidia=True)
    assert not passes("jax._src.xla_bridge", TPU_TOPOLOGY) and passes("jax._src.xla_bridge", CUDA_PLUGIN,
                                                                      "jax_plugins.xla_cuda12")
    machine(tpu=False, nvidia=False)
    assert passes("jax._src.xla_bridge", CUDA_PLUGIN, "jax_plugins.my_plugin")  # another plugin's failure


# jax's backends start in a fresh interpreter (they start once per process), with every plugin the
# environment has: JAX_PLATFORMS unset, as a user runs it.
_JAX_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
if sys.argv[1] == "quiet":
    from jaxserve.core.quiet import quiet_startup
    quiet_startup()
import jax
print("backend", jax.default_backend(), flush=True)
"""


def _jax_start(mode: str) -> str:
    env = {k: v for k, v in child_env().items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", _JAX_START, mode], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_jax_backend_start_up_noise_is_dropped_where_the_hardware_is_absent():
    """The real records: the CUDA plugin's traceback and the TPU backend's line, which jax logs
    where the plugin or libtpu is installed on a machine without the device."""
    import importlib.util

    expected = []
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is not None and not quiet.has_nvidia_device_files():
        expected.append("Jax plugin configuration error")
    if importlib.util.find_spec("libtpu") is not None and not quiet.has_tpu_device_files():
        expected.append("Unable to initialize backend 'tpu'")
    # the test extra installs both (jax[cuda12] and libtpu); no machine has both devices
    assert expected, "the test extra should install jax's CUDA plugin and libtpu: neither is here without its device"
    loud = _jax_start("loud")
    assert all(noise in loud for noise in expected), loud  # what the filters are for is there
    quieted = _jax_start("quiet")
    assert "backend cpu" in quieted, quieted
    assert not any(noise in quieted for noise in expected) and "Traceback" not in quieted, quieted


def test_quiet_startup_keeps_absls_own_logger_class():
    """absl makes "absl" an ABSLLogger only if nothing created that logger first; a plain Logger
    names absl's own file as every record's origin, and the orbax filter would drop nothing."""
    code = ("import logging; from jaxserve.core.quiet import quiet_startup; quiet_startup(); import absl.logging; "
            "print(type(logging.getLogger('absl')).__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "ABSLLogger", done.stdout + done.stderr


def test_orbax_info_lines_are_dropped_and_its_warnings_kept(tmp_path):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    quiet_startup()
    absl_logger = logging.getLogger("absl")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, level = Keep(), absl_logger.level
    absl_logger.addHandler(handler)
    absl_logger.removeFilter(quiet._FILTERS["absl"])  # the records as orbax makes them
    absl_logger.setLevel(logging.INFO)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "ckpt", {"w": jnp.ones(4)})
            checkpointer.restore(tmp_path / "ckpt")
    finally:
        absl_logger.removeHandler(handler)
        absl_logger.setLevel(level)
        quiet_startup()
    orbax = [r for r in records if f"{os.sep}orbax{os.sep}" in r.pathname]
    assert len(orbax) > 10, [r.getMessage() for r in records]  # what the filter is for is there
    assert not any(absl_logger.filter(r) for r in orbax if r.levelno < logging.WARNING)
    warning = logging.makeLogRecord({**vars(orbax[0]), "levelno": logging.WARNING, "levelname": "WARNING"})
    assert absl_logger.filter(warning)
    assert passes("absl", "a flag note", pathname="/site-packages/tokamax/config.py")  # not orbax's
    assert not passes("absl", "Loading cache file: /x/pallas_triton_ragged_dot.json",
                      pathname="/site-packages/tokamax/_src/autotuning/cache.py")  # tokamax's cache files


def test_a_prompt_past_the_tokenizers_model_max_length_encodes_without_a_warning():
    """transformers warns "Token indices sequence length is longer than the specified maximum" past
    tokenizer_config's model_max_length; jaxserve's limit is max_model_len, enforced by the server."""
    from jaxserve.default_model import ensure_default_model
    from jaxserve.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(ensure_default_model())
    text = "hi " * (tokenizer.hf.model_max_length + 10)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logging.getLogger("transformers").addHandler(handler)  # it does not propagate to the root
    try:
        assert len(tokenizer.encode(text)) > tokenizer.hf.model_max_length
        assert records == []
        tokenizer.hf.encode(text)  # transformers' own call, as a control: it does warn
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert ["Token indices sequence length" in r.getMessage() for r in records] == [True]
