"""README.md's "Will it fit?" block runs as written: its `pip install` line against the stand-in
pip, then each `jaxserve plan` line, which must print the numbers of its row of the README's table.

Beside tests/test_readme.py (which claims every other block, and checks that every block has one
runner) because its three compile-only plans take minutes: a file of their own lets --dist loadfile
run them on one worker while the README's server runs on the other."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from own_process import REPO
from test_readme import README, _commands, _env, _of_kind, _run_bash, bin_dir  # noqa: F401 (bin_dir: a fixture)


def _table_rows() -> dict[tuple[str, str], list[str]]:
    """The "Will it fit?" table: (model, target) -> its cells."""
    text = README.read_text()
    section = text[text.index("## Will it fit?"):text.index("## Offline generation")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    return {(r[0], r[1]): r for r in rows}


def test_the_planner_block_prints_the_readme_table(bin_dir, tmp_path):
    """Each `jaxserve plan` line of the block, as written, prints the numbers of its table row."""
    (block,) = _of_kind("plan")
    rows = _table_rows()
    env = _env(bin_dir)
    lines = _commands(block)
    assert lines[0].startswith("pip install")
    _run_bash(lines[0], Path(REPO), env)
    plans = [line for line in lines[1:] if line.startswith("jaxserve plan")]
    assert plans and len(plans) == len(lines) - 1
    for command in plans:
        out = _run_bash(command, Path(REPO), env)
        row = rows[_row_key(command)]
        figures = _plan_figures(out)
        assert row[2:5] == [figures["weights"], figures["KV pool"],
                            f"{figures['compiled temporaries']} + {figures['program code']}"], (row, out)
        assert row[5].startswith("yes" if "-> FITS" in out else "no"), (row, out)
        assert row[6] == str(figures["sequences"]), (row, out)
        assert row[7].split(" ")[0] == figures["decode b=64"], (row, out)


def _row_key(command: str) -> tuple[str, str]:
    config = Path(shlex.split(command)[2]).stem
    target = re.search(r"--target (\S+)", command)[1]
    model = {"qwen3-8b": "Qwen3-8B", "llama-3.1-70b": "Llama-3.1-70B"}[config]
    return model, {"tpu-v6e:2x4": "TPU v6e-8 (32 GiB)", "gpu-h200:1x1x8": "8 x H200 (141 GB)"}[target]


def _plan_figures(out: str) -> dict:
    figures = {name: re.search(rf"^  {name}\s+(\S+ \S+)$", out, re.M)[1]
               for name in ("weights", "KV pool", "compiled temporaries", "program code")}
    settings = dict(re.findall(r"(\w+)=(\d+)", re.search(r"^settings: (.*)$", out, re.M)[1]))
    pool_tokens = int(settings["num_kv_pages"]) * int(settings["page_size"])
    figures["sequences"] = pool_tokens // int(settings["max_model_len"])
    figures["decode b=64"] = re.search(r"^decode b=64 .* (\S+)$", out, re.M)[1]
    return figures
