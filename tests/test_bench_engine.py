"""scripts/bench_engine.py in smoke size: the decode benchmark and its step-time breakdown run
end to end on the tiny preset and report consistent parts (no timing thresholds)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_engine  # noqa: E402


def test_breakdown_reports_every_part_and_compiles_nothing_after_warmup(tmp_path):
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--preset", "tiny", "--batches", "2", "--context", "24", "--steps", "3",
                              "--repeats", "2", "--breakdown", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bandwidth"] > 0 and report["read_bandwidth"] > 0 and report["matmul_rate"] > 0
    (row,) = report["rows"]
    assert row["batch"] == 2 and row["recompiles"] == 0
    assert row["tokens_per_s"] > 0 and 0 < row["fraction_of_bound"] and 0 < row["fraction_of_read_bound"]
    parts = row["breakdown_ms"]
    assert set(parts) == {"forward", "attention", "lm_head", "layers_and_rest", "sampler", "host", "detokenize"}
    assert all(v >= 0 for v in parts.values())
    assert parts["forward"] > 0 and parts["sampler"] > 0 and parts["lm_head"] > 0 and parts["detokenize"] > 0
    # The forward's parts never add up to more than the forward itself.
    assert parts["attention"] + parts["lm_head"] + parts["layers_and_rest"] >= parts["forward"] - 1e-9
    assert parts["attention"] <= parts["forward"]
