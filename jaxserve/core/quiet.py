"""Log filters for start-up messages that are harmless but alarming in a JAX engine. Each filter
drops one known message and nothing else, so real warnings and errors still reach the log.

- jax logs "Unable to initialize backend 'tpu': ... libtpu.so ..." on every machine without libtpu
  (every CPU and GPU machine), and "Unable to initialize backend 'tpu': INTERNAL: Failed to get
  global TPU topology" (or another reason) where libtpu is installed on a machine without TPU device
  files. A TPU machine whose libtpu is installed but fails keeps the message.
- jax's CUDA plugin (jax[cuda], or the test extra on a CPU machine) logs an ERROR with a traceback
  ("cuInit(0) failed", "no CUDA devices") on a machine with no NVIDIA device: nothing is missing
  there, and the model runner's "machine:" line names the backend in use. Where an NVIDIA device
  exists, the plugin's failure is a real problem and keeps its traceback.
- Where libtpu is installed but the machine has no TPU (the test extra brings it, for compile-only
  TPU targets), libtpu asks the cloud metadata server for its slice and prints warnings about
  TPU_ACCELERATOR_TYPE and worker hostnames on stderr; `quiet_libtpu` tells it there is nothing to
  ask (environment variables; set only on a machine without TPU device files).
- transformers warns "PyTorch was not found. Models won't be available ..." when imported without
  torch. jaxserve uses transformers for tokenizers only, so without torch nothing is missing.
- orbax-checkpoint logs about 20 INFO lines (through absl's logger) per save or restore: versions,
  handler options, throughputs, metadata stores. Its warnings and errors are kept.
- tokamax logs INFO lines about its autotuning cache files, and a WARNING "Autotuning cache miss
  for <kernel> on <GPU> with key <shapes>" (20 lines each) for every grouped matmul it lowers for a
  GPU this machine does not have (`jaxserve plan --target gpu-...`): with no device there is nothing
  to tune, and its default config is used. Its cache-file INFO lines go everywhere (its other lines
  stay); the warning only where no NVIDIA device is attached.
- uvicorn logs an access line for every /health and /metrics poll (clients and load balancers poll
  /health many times while the model loads, between the progress bars), and "Uvicorn running on
  URL" when it binds, long before the model is ready; launch.py logs its own line instead.

Filters sit on the emitting logger, so they work whatever handlers are configured later, and adding
them twice is harmless (`Logger.addFilter` keeps one copy).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Callable

QUIET_PATHS = frozenset({"/health", "/metrics"})


class _Drop(logging.Filter):
    def __init__(self, matches: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


# The device files jax's own checks look for (jax._src.hardware_utils), read when a record comes
# (a few per start-up) so that tests can stand in for either kind of machine.
_NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def has_tpu_device_files() -> bool:
    """TPU chips are attached: /dev/accel* (v2-v4) or /dev/vfio/N (v5e and later)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def has_nvidia_device_files() -> bool:
    return any(os.path.exists(path) for path in _NVIDIA_DEVICE_FILES)


def _tpu_backend_unavailable(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not message.startswith("Unable to initialize backend 'tpu'"):
        return False
    return "libtpu.so" in message or not has_tpu_device_files()


def _cuda_plugin_without_gpu(record: logging.LogRecord) -> bool:
    # jax: logger.exception("Jax plugin configuration error: Exception when calling %s.initialize()",
    # "jax_plugins.xla_cuda12"); the module is xla_cuda13 for CUDA 13.
    return (record.getMessage().startswith("Jax plugin configuration error: Exception when calling "
                                           "jax_plugins.xla_cuda")
            and not has_nvidia_device_files())


def _orbax_info(record: logging.LogRecord) -> bool:
    # absl's logger names the caller's file: orbax's own modules, wherever the package is installed.
    return record.levelno < logging.WARNING and f"{os.sep}orbax{os.sep}" in record.pathname


_TOKAMAX_CACHE_INFO = ("Loading cache file: ", "Autotuning cache file not found: ")


def _tokamax_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if record.levelno < logging.WARNING and message.startswith(_TOKAMAX_CACHE_INFO):
        return f"{os.sep}tokamax{os.sep}" in record.pathname
    return message.startswith("Autotuning cache miss for ") and not has_nvidia_device_files()


def _torch_not_found(record: logging.LogRecord) -> bool:
    return record.getMessage().startswith("PyTorch was not found.")


def _polling_access_line(record: logging.LogRecord) -> bool:
    # uvicorn.access args: (client address, method, path with query, HTTP version, status)
    args = record.args
    if not isinstance(args, tuple) or len(args) != 5 or not isinstance(args[2], str):
        return False
    return args[2].split("?", 1)[0] in QUIET_PATHS


def _uvicorn_running_line(record: logging.LogRecord) -> bool:
    return isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on")


_FILTERS: dict[str, logging.Filter] = {
    "jax._src.xla_bridge": _Drop(lambda r: _tpu_backend_unavailable(r) or _cuda_plugin_without_gpu(r)),
    "absl": _Drop(lambda r: _orbax_info(r) or _tokamax_noise(r)),
    "transformers": _Drop(_torch_not_found),
    "uvicorn.access": _Drop(_polling_access_line),
    "uvicorn.error": _Drop(_uvicorn_running_line),
}


def quiet_startup() -> None:
    """Installs the filters. Call before transformers is imported (it warns at import time) and
    before jax initialises its backends (the first array or device query)."""
    quiet_libtpu()
    # absl makes its "absl" logger an ABSLLogger (whose records name the caller's file, which the
    # orbax filter reads) only if that logger does not exist yet: create it first.
    import absl.logging  # noqa: F401

    for name, log_filter in _FILTERS.items():
        logging.getLogger(name).addFilter(log_filter)


def quiet_libtpu() -> None:
    """On a machine without TPU chips: libtpu skips the metadata query (and its warnings) and its
    one-process lock file (compile-only use owns no chips, so processes need not exclude each other)."""
    if has_tpu_device_files():
        return
    for key, value in {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
                       "TPU_ACCELERATOR_TYPE": "v6e-4", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
        os.environ.setdefault(key, value)
