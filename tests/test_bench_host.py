"""scripts/bench_host.py runs (a smoke run per mode with the stand-in device: no compile) and its
stand-in device keeps the engine honest: the ids it returns come back in step order, a
constrained row gets a token its grammar allows, and steps stay asynchronous with penalties on."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_host  # noqa: E402


def test_every_mode_runs_on_the_stand_in_device():
    rows = [bench_host.run(8, 64, mode, steps=2, repeats=1, fake_device_ms=0.0)
            for mode in ("sampling", "greedy", "ngram", "structured")]
    for r in rows:
        assert r["wall_ms"] > 0 and r["host_ms"] > 0 and r["recompiles"] == 0
        assert set(r["stages_ms"]) == {"schedule", "build", "mask", "update", "dispatch"}
    sampling, greedy, ngram, structured = rows
    assert sampling["sync_steps"] == 0 and greedy["sync_steps"] == 0  # penalties stay asynchronous
    assert ngram["sync_steps"] > 0  # speculation needs each step's last token
    assert structured["stages_ms"]["mask"] > 0  # every row constrained: masks built each step


def test_the_cpu_clock_times_the_engine_thread_and_is_put_back():
    """--clock cpu: the stages read the engine thread's CPU time during the run only; it needs the
    stand-in device (the real device works on other threads)."""
    import time

    import pytest

    from jaxserve.engine import engine_core

    r = bench_host.run(8, 64, "greedy", steps=3, repeats=1, fake_device_ms=20.0, clock="cpu")
    assert r["clock"] == "cpu" and engine_core.time is time
    # the stand-in device's 20 ms per step are a sleep: wall time counts them, CPU time does not
    wall = bench_host.run(8, 64, "greedy", steps=3, repeats=1, fake_device_ms=20.0)
    assert r["wall_ms"] < 10.0 < wall["wall_ms"]
    with pytest.raises(SystemExit):
        bench_host.main(["--rows", "8", "--clock", "cpu"])
