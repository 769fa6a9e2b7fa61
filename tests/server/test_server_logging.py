"""jaxserve.core.quiet: each log filter drops its one known message and keeps everything else.
(The real `jaxserve serve` log is checked in test_server_lifecycle.py and
tests/test_runtime_dependencies.py.)"""

from __future__ import annotations

import logging

import pytest

from jaxserve.core.quiet import quiet_startup

ACCESS = '%s - "%s %s HTTP/%s" %d'  # uvicorn's access-log format


def passes(logger: str, msg: str, *args: object, level: int = logging.INFO) -> bool:
    quiet_startup()
    record = logging.LogRecord(logger, level, __file__, 1, msg, args, None)
    return bool(logging.getLogger(logger).filter(record))


@pytest.mark.parametrize("logger,msg,args", [
    ("jax._src.xla_bridge", "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
     "cannot open shared object file: No such file or directory", ()),
    ("transformers", "PyTorch was not found. Models won't be available and only tokenizers, configuration and "
     "file/data utilities can be used.", ()),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "GET", "/health", "1.1", 503)),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "GET", "/metrics?name=x", "1.1", 200)),
    ("uvicorn.error", "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", ("http", "127.0.0.1", 8000)),
])
def test_known_noise_is_dropped(logger, msg, args):
    assert not passes(logger, msg, *args)


@pytest.mark.parametrize("logger,msg,args", [
    # libtpu is installed but fails: a real problem on a TPU machine
    ("jax._src.xla_bridge", "Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by pid 7", ()),
    ("jax._src.xla_bridge", "Unable to initialize backend 'cuda': no CUDA devices", ()),
    ("transformers", "Token indices sequence length is longer than the specified maximum", ()),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "POST", "/v1/completions", "1.1", 200)),
    ("uvicorn.access", ACCESS, ("127.0.0.1:5000", "GET", "/healthz", "1.1", 404)),
    ("uvicorn.error", "Started server process [%d]", (42,)),
    ("uvicorn.error", "Cancel %s running task(s), timeout graceful shutdown exceeded", (1,)),
])
def test_everything_else_is_kept(logger, msg, args):
    assert passes(logger, msg, *args)
