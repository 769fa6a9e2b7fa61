"""The device check cannot rot: its CPU dry run (tiny shapes, the same stages, the same JSON) runs
here through the same shell entry points a GPU machine or a TPU VM runs (scripts/device_check.sh,
scripts/tpu_check.sh), and a stage past its time limit is stopped and reported, not waited for."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import device_check  # noqa: E402
from device_profile import PROFILES, dry_run  # noqa: E402


def _run(script: str, out: Path, *args: str) -> dict:
    done = subprocess.run(["bash", f"scripts/{script}", "--dry-run", *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "OUT": str(out)}, timeout=1200)
    assert (out / "device_check.json").exists(), (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads((out / "device_check.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], json.dumps(report["summary"]))
    return report


@pytest.fixture(scope="module")
def gpu_dry_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    return _run("device_check.sh", out), out


def test_every_stage_passes_and_writes_its_figures(gpu_dry_run):
    report, out = gpu_dry_run
    assert report["summary"] == dict.fromkeys(("env", "kernels", "serve", "peer", "features", "plan"), "PASS")
    assert report["profile"] == "gpu-dry-run" and report["dry_run"]
    stages = report["stages"]
    # the dry run shares a 24 GiB CI machine with the suite's other worker: no stage may size itself
    # from free RAM (transformers' continuous batching did, 13.6 GiB, and CI's worker died of it)
    peaks = {name: stage["peak_rss_mib"] for name, stage in stages.items()}
    assert all(0 < mib < 4096 for mib in peaks.values()), peaks
    # kernels: the GPU kernel (interpreted here) against the reference in bf16, f32, int8 and fp8 pages
    pages = {(a["dtype"], a["pages"]) for a in stages["kernels"]["attention"]}
    assert pages == {("bfloat16", "bfloat16"), ("float32", "float32"), ("bfloat16", "int8"),
                     ("bfloat16", "float8_e4m3fn")}
    assert all(a["ok"] for a in stages["kernels"]["attention"]) and stages["kernels"]["moe"]["ok"]
    # serve: `jaxserve serve --load-format dummy`, the whole burst answered, no compile after warm-up
    serve = stages["serve"]
    assert "--load-format dummy" in serve["command"] and serve["warmup_programs"] > 0
    bench = serve["bench"]
    assert bench["completed"] == dry_run("gpu").workload.num_requests and bench["failed"] == 0
    assert bench["output_throughput"] > 0 and bench["ttft_ms"]["p50"] > 0 and bench["tpot_ms"]["p50"] > 0
    assert serve["compilations_after_warmup"] == 0
    top = serve["decode_steps"][-1]
    assert top["steps"] > 0 and top["step_ms"] > 0 and 1 <= top["rows"] <= top["bucket"]
    # the decode step against the roofline and the plan, and the ratio to transformers
    decode = report["decode"]
    assert decode["roofline_ms"] > 0 and decode["pct_of_roofline"] > 0 and decode["plan_ms"] > 0
    assert stages["plan"]["target"] == "gpu-h200:1x1x1"
    assert report["vs_transformers"]["static"] > 0
    # features: the lossless ones equal the plain engine, the schema's output parses
    variants = {v["variant"]: v for v in stages["features"]["variants"]}
    assert set(variants) == {"plain", "ngram speculation", "lora, base rows", "int8 KV pages", "fp8 KV pages",
                             "int8 weights", "json schema"}
    for name in ("ngram speculation", "lora, base rows"):
        assert variants[name]["identical_rows"] == variants[name]["rows"], name
    assert variants["lora, base rows"]["adapter_tokens_differ"]
    assert variants["json schema"]["valid"]
    assert all(v["steps"] > 0 for v in variants.values())


def test_the_markdown_and_the_logs_come_back(gpu_dry_run):
    report, out = gpu_dry_run
    assert {p.name for p in out.iterdir()} == {"device_check.json", "device_check.md", "device_check.log",
                                               "server.log"}
    md = (out / "device_check.md").read_text()
    for stage, status in report["summary"].items():
        assert f"| {stage} | {status} |" in md
    assert "| ngram speculation |" in md and "| decode_rand | bfloat16 | int8 |" in md
    assert "warm-up compiled" in (out / "server.log").read_text()


def test_tpu_check_runs_the_tpu_kernel_and_plans_for_a_tpu(tmp_path):
    report = _run("tpu_check.sh", tmp_path, "--stages", "env,kernels,peer")
    assert report["profile"] == "tpu-dry-run"
    assert report["summary"] == {"env": "PASS", "kernels": "PASS", "serve": "NOT RUN", "peer": "NOT RUN",
                                 "features": "NOT RUN", "plan": "PASS"}
    assert "torch_xla" in report["stages"]["peer"]["error"]  # why it does not run there
    assert report["stages"]["plan"]["target"] == PROFILES["tpu"].target
    assert report["stages"]["plan"]["decode"]["seconds"] > 0


def test_a_stage_past_its_limit_is_stopped_and_reported_skipped(tmp_path):
    profile = dry_run("gpu")
    profile = dataclasses.replace(profile, limits={**profile.limits, "env": 0.5},
                                  floors={**profile.floors, "env": 0.1})
    report = device_check.run_check(profile, tmp_path, budget_s=12.0, stages=("env",))
    env = report["stages"]["env"]
    assert env["status"] == "SKIPPED" and "time limit" in env["error"] and env["seconds"] < 5
    # the plan started after it gets what is left of the budget, and is stopped there too
    assert report["summary"]["plan"] == "SKIPPED" and report["stages"]["plan"]["seconds"] < 10
    # a stage that is not even given its floor is not started
    late = device_check.run_check(profile, tmp_path / "late", budget_s=1.0, stages=("kernels",))
    assert late["summary"]["kernels"] == "SKIPPED" and "not started" in late["stages"]["kernels"]["error"]


def test_a_report_that_cannot_be_made_still_returns_what_was_measured(tmp_path, monkeypatch):
    def broken(*args):
        raise ZeroDivisionError("a figure of zero")

    monkeypatch.setattr(device_check, "make_report", broken)
    profile = dry_run("gpu")
    profile = dataclasses.replace(profile, limits={**profile.limits, "plan": 0.5}, floors={**profile.floors, "plan": 0.1})
    device_check.run_check(profile, tmp_path, budget_s=60.0, stages=("env",))
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["summary"]["env"] == "PASS" and report["summary"]["report"] == "FAIL"
    assert report["stages"]["env"]["num_devices"] >= 1 and "ZeroDivisionError" in report["error"]
    assert "| report | FAIL |" in (tmp_path / "device_check.md").read_text()
