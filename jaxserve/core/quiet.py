"""Log filters for start-up messages that are harmless but alarming in a JAX engine. Each filter
drops one known message and nothing else, so real warnings and errors still reach the log.

- jax logs "Unable to initialize backend 'tpu': ... libtpu.so ..." on every machine without libtpu
  (every CPU and GPU machine). A TPU machine whose libtpu is installed but fails keeps the message.
- Where libtpu is installed but the machine has no TPU (the test extra brings it, for compile-only
  TPU targets), libtpu asks the cloud metadata server for its slice and prints warnings about
  TPU_ACCELERATOR_TYPE and worker hostnames on stderr; `quiet_libtpu` tells it there is nothing to
  ask (environment variables; set only on a machine without TPU device files).
- transformers warns "PyTorch was not found. Models won't be available ..." when imported without
  torch. jaxserve uses transformers for tokenizers only, so without torch nothing is missing.
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


def _missing_libtpu(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return message.startswith("Unable to initialize backend 'tpu'") and "libtpu.so" in message


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
    "jax._src.xla_bridge": _Drop(_missing_libtpu),
    "transformers": _Drop(_torch_not_found),
    "uvicorn.access": _Drop(_polling_access_line),
    "uvicorn.error": _Drop(_uvicorn_running_line),
}


def quiet_startup() -> None:
    """Installs the filters. Call before transformers is imported (it warns at import time) and
    before jax initialises its backends (the first array or device query)."""
    quiet_libtpu()
    for name, log_filter in _FILTERS.items():
        logging.getLogger(name).addFilter(log_filter)


def quiet_libtpu() -> None:
    """On a machine without TPU chips: libtpu skips the metadata query (and its warnings) and its
    one-process lock file (compile-only use owns no chips, so processes need not exclude each other)."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    for key, value in {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
                       "TPU_ACCELERATOR_TYPE": "v6e-4", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
        os.environ.setdefault(key, value)
