"""The start-up's progress bars (engine/loading.load_with_progress): the loading bar ticks once per
checkpoint tensor and once for the engine, and log lines written while a bar shows start a line of
their own instead of landing on the bar's. (The filters of known noise: tests/server/test_server_logging.py;
load_weights' ticks over several files: tests/test_checkpoints.py.)"""

from __future__ import annotations

import io
import logging
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

from jaxserve.engine import loading

TENSORS = 3


def _fake_build(model, engine_cfg, tokenizer, bar):
    """_build's contract with the bar, without a model: weights(done, total) per tensor, then engine()."""
    log = logging.getLogger("jaxserve.test")
    for done in range(TENSORS + 1):
        bar.weights(done, TENSORS)
    log.info("while the weights load")
    bar.engine()
    log.info("while the KV pool is allocated")

    def warmup(progress, background):
        progress(1, 2, "first")
        log.info("while the programs compile")
        progress(2, 2, "second")

    tokenizer_load: Future = Future()
    tokenizer_load.set_result("tokenizer")
    return SimpleNamespace(runner=SimpleNamespace(warmup=warmup)), tokenizer_load, Path("model")


def test_log_lines_written_while_the_bars_show_start_their_own_line(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(loading, "_build", _fake_build)
    handler = logging.StreamHandler(sys.stderr)  # as logging.basicConfig makes it (cli.py)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    before = list(root.handlers)
    try:
        _, tokenizer, _ = loading.load_with_progress(None, SimpleNamespace(warmup="full"))
        assert root.handlers == before  # the console handler is back once the bars are done
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert tokenizer == "tokenizer"
    out = stderr.getvalue()
    for message in ("while the weights load", "while the KV pool is allocated", "while the programs compile"):
        [line] = [line for line in out.split("\n") if message in line]
        # what a terminal shows of the line: the text after its last carriage return
        assert line.rsplit("\r", 1)[-1] == f"INFO jaxserve.test: {message}", repr(line)
    assert f"{TENSORS}/{TENSORS + 1} [" in out and "KV pool" in out, out  # redrawn under the log line
    assert f"{TENSORS + 1}/{TENSORS + 1} [" in out, out
