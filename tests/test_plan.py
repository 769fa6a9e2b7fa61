"""`jaxserve plan` (plan.py): memory figures checked against what the engine allocates on a CPU,
fit / no-fit against hand arithmetic on compile-only TPUs, collectives read off compiled HLO,
the sweep, and the command's output and errors."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading

import jax
import pytest

from jaxserve.entrypoints import cli
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.engine.engine_core import EngineCore
from jaxserve.parallel.layouts import make_layout
from jaxserve.model.weights import init_random
from jaxserve.planning.plan import plan_deployment, sweep
from jaxserve.planning.compiled_memory import collectives_in
from jaxserve.core.buckets import Program, history_buckets
from jaxserve.parallel.sharding import make_mesh
from jaxserve.planning.targets import parse_target

GIB = 2**30


def _config(**kw) -> ModelConfig:
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "max_position_embeddings": 256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    return ModelConfig.from_hf({**raw, **kw})


def _bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_cpu_plan_matches_the_bytes_the_engine_allocates():
    """Weights, KV pool and the largest program's temporaries: the planner (shapes only) against
    the arrays a real engine holds and what XLA compiled for it, within 5%."""
    cfg = _config()
    engine_cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)  # pool and context from the machine
    plan = plan_deployment(cfg, parse_target("cpu"), make_layout("tp", 1), engine_cfg, "float32")
    core = EngineCore(cfg, init_random(cfg), engine_cfg, make_mesh(1, 1))
    weights, pool = _bytes(core.runner.weights), _bytes(core.runner.kv)
    assert plan.weight_bytes == pytest.approx(weights, rel=0.05)
    assert plan.kv_pool_bytes == pytest.approx(pool, rel=0.05)
    assert plan.settings["num_kv_pages"] == core.engine_cfg.num_kv_pages
    # the plan's temporaries are its largest program's: the largest forward or the widest sampler
    largest = max(p for p in core.runner.builder.buckets)
    widest = Program("sample", rows=max(s for _, s in core.runner.builder.buckets),
                     history=max(history_buckets(core.engine_cfg.max_model_len, cfg.vocab_size)))
    temps = {p.kind: core.runner.compile(p).memory_analysis().temp_size_in_bytes
             for p in (Program("forward", *largest), widest)}
    assert plan.temp_bytes >= temps["forward"]
    assert plan.temp_bytes == pytest.approx(max(temps.values()), rel=0.05)
    assert plan.fits and plan.programs_compiled == 3


def test_plans_that_differ_only_in_pool_size_compile_each_program_once(monkeypatch):
    """The programs are compiled at two small pool sizes whatever the pool: a second plan of the
    same model and buckets reuses every compile (a sweep's or a fit search's repeated programs)."""
    from jaxserve.planning import compiled_memory

    compiled = []
    real = compiled_memory._compile_memory
    monkeypatch.setattr(compiled_memory, "_COMPILED", {})
    monkeypatch.setattr(compiled_memory, "_compile_memory", lambda lowered, program, *a: compiled.append(program.name)
                        or real(lowered, program, *a))
    plans = [plan_deployment(_config(), parse_target("cpu"), make_layout("tp", 1),
                             EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=mib * 2**20),
                             "float32") for mib in (8, 16)]
    assert plans[0].kv_pool_bytes == pytest.approx(plans[1].kv_pool_bytes / 2, rel=0.05)
    # for both plans together: each forward at the two pool sizes, the sampler once
    assert len(compiled) == 2 * (plans[0].programs_compiled - 1) + 1 and plans[0].programs_compiled == 3


# Hand arithmetic for the fit cases: a Llama-shaped model, 4 layers at 70B-class widths, bf16.
BIG = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192, intermediate_size=28672,
           num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
           tie_word_embeddings=False, torch_dtype="bfloat16")
D, F, L, V, KV = 8192, 28672, 4, 128256, 8 * 128
PARAMS = L * (2 * D * D + 2 * D * KV + 3 * D * F + 2 * D) + 2 * V * D + D   # 4 layers + embed + lm_head + norm
WEIGHT_BYTES = 2 * PARAMS                                                    # bf16: 2 bytes each
USABLE_V5E = 0.9 * 16 * GIB


@pytest.mark.parametrize("target,tp,pool_gib,fits", [
    ("tpu-v5e:1x1", 1, 2, True),    # 10.29 GiB weights + 2 GiB pool + temporaries < 0.9 x 16 = 14.4 GiB
    ("tpu-v5e:1x1", 1, 6, False),   # 10.29 + 6 = 16.29 GiB > 14.4 GiB before any temporaries
    ("tpu-v5e:2x2", 4, 6, True),    # weights split 4 ways: 2.57 + 6 GiB
])
def test_fit_answers_match_hand_arithmetic(target, tp, pool_gib, fits):
    assert PARAMS == 5_523_972_096 and WEIGHT_BYTES / GIB == pytest.approx(10.29, abs=0.01)
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=4096,
                          kv_cache_memory=pool_gib * GIB)  # one forward bucket: a short compile
    # one of the 4 layers compiled (code scaled to depth, temporaries as compiled): the fit arithmetic
    # takes the plan's temporaries and code whatever their depth, and the weights come from the
    # declaration of all 4 (a full-depth compile took 45 of this test's 47 s on an AMD EPYC)
    plan = plan_deployment(ModelConfig.from_hf(BIG), parse_target(target), make_layout("tp", tp, tp), engine,
                           "bfloat16", compile_layers=1)
    if tp == 1:
        assert plan.weight_bytes == WEIGHT_BYTES
    else:  # every weight splits 4 ways except the norms
        assert plan.weight_bytes == pytest.approx(WEIGHT_BYTES / 4, rel=1e-3)
    assert plan.kv_pool_bytes == pytest.approx(pool_gib * GIB, rel=0.01)  # 16 tokens x 8 KV heads fill pages
    hand = plan.weight_bytes + pool_gib * GIB + plan.temp_bytes + plan.code_bytes
    assert plan.total_bytes == pytest.approx(hand, rel=0.01)
    assert plan.fits is fits is (hand <= USABLE_V5E)
    if not fits:
        assert plan.headroom_bytes < 0 and any("--kv-cache-memory" in a for a in plan.advice)


@pytest.mark.parametrize("tp", [1, 4])
def test_lora_slots_are_counted_from_their_declaration(tp):
    """--enable-lora: the slots' bytes per device (hand arithmetic: a [in, N, R] and b [N, R, out] per
    projection and layer, split like the projection) enter the total, and a pool sized from memory
    gives them its room."""
    n, r = 4, 64
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=4096)
    with_lora = dataclasses.replace(engine, enable_lora=True, max_loras=n, max_lora_rank=r)
    target, layout = parse_target("tpu-v5e:2x2"), make_layout("tp", tp, tp)
    plain = plan_deployment(ModelConfig.from_hf(BIG), target, layout, engine, "bfloat16", compile_programs=False)
    plan = plan_deployment(ModelConfig.from_hf(BIG), target, layout, with_lora, "bfloat16", compile_programs=False)
    # q, o: D <-> D; k, v: D -> KV; gate, up: D -> F; down: F -> D; the split side is divided by tp
    per_layer = (2 * (D + D // tp) + 2 * (D + KV // tp) + 3 * (D + F // tp)) * n * r * 2
    assert plain.lora_bytes == 0 and plan.lora_bytes == L * per_layer
    assert plan.weight_bytes == plain.weight_bytes
    # a pool sized from memory is rounded down by at most 1/16 (capacity.stable_page_count)
    assert plan.kv_pool_bytes <= plain.kv_pool_bytes
    assert plan.kv_pool_bytes + plan.lora_bytes <= plain.kv_pool_bytes * 16 / 15
    assert plan.fits and plan.total_bytes <= plan.usable_bytes
    assert plan.total_bytes - plan.kv_pool_bytes == plain.total_bytes - plain.kv_pool_bytes + plan.lora_bytes


def test_collectives_are_read_from_compiled_tp_programs():
    cfg = _config(num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    # 16 tokens for 8 sequences: the decode forward (whose collectives are read) is the largest, so
    # the plan compiles no second forward the collectives do not come from
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    plan = plan_deployment(cfg, parse_target("tpu-v6e:2x2"), make_layout("tp", 4), engine, "bfloat16")
    reduce = {c.kind: c for c in plan.collectives}["all-reduce"]
    # one after attention and one after the MLP in each of the 2 layers, over [T=16, hidden 128] bf16 rows
    assert reduce.count >= 2 * cfg.num_layers
    assert reduce.bytes >= 2 * cfg.num_layers * 16 * 128 * 2
    single = plan_deployment(cfg, parse_target("tpu-v6e:1x1"), make_layout("tp", 1), engine, "bfloat16")
    assert single.collectives == []


def test_collectives_parser_counts_sync_and_async_ops():
    hlo = "\n".join([
        "  %ar = bf16[16,128]{1,0} all-reduce(bf16[16,128]{1,0} %x), replica_groups={{0,1,2,3}}",
        "  %ag = (f32[4,256]{1,0}, f32[16,256]{1,0}) all-gather-start(f32[4,256]{1,0} %y), dimensions={0}",
        "  %agd = f32[16,256]{1,0} all-gather-done((f32[4,256]{1,0}, f32[16,256]{1,0}) %ag)",
        "  %ar2 = bf16[16,128]{1,0} all-reduce(bf16[16,128]{1,0} %z), to_apply=%add",
        "  %dot = f32[16,16]{1,0} dot(f32[16,128]{1,0} %a, f32[128,16]{1,0} %b)"])
    got = {c.kind: (c.count, c.bytes) for c in collectives_in(hlo)}
    assert got == {"all-reduce": (2, 2 * 16 * 128 * 2), "all-gather": (1, 16 * 256 * 4)}


def test_sweep_ranks_fitting_layouts_by_tokens_per_chip():
    cfg = _config(num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
    # 8 tokens for 8 sequences: the decode bucket is the largest, one forward per layout to compile
    plans = sweep(cfg, parse_target("tpu-v6e:2x2"), EngineConfig(max_num_batched_tokens=8, max_model_len=128),
                  "bfloat16", batch=8, context=128)
    assert {p.layout for p in plans} == {"tp dp=4 tp=1", "tp dp=2 tp=2", "tp dp=1 tp=4",
                                         "tp-vocab-replicated dp=2 tp=2", "tp-vocab-replicated dp=1 tp=4",
                                         "tp-kv-replicated dp=2 tp=2", "tp-kv-replicated dp=1 tp=4"}
    from jaxserve.planning.plan import decode_tokens_per_chip
    rates = [decode_tokens_per_chip(p, 8) for p in plans if p.fits]
    assert rates == sorted(rates, reverse=True) and all(r > 0 for r in rates)


def test_plan_command_prints_table_json_and_plot(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 256}))
    png = tmp_path / "plan.png"
    assert cli.main(["plan", str(config), "--target", "tpu-v5e:2x2", "--tp", "2", "--max-num-seqs", "8",
                     "--max-num-batched-tokens", "32", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "target tpu-v5e:2x2 (TPU v5 lite), layout tp dp=2 tp=2, float32" in out and "-> FITS" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["plan", str(config), "--target", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens",
                     "32", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"] == "cpu:1" and data["fits"] and data["weight_bytes"] > 0
    assert math.isclose(data["total_bytes"], data["weight_bytes"] + data["kv_pool_bytes"] + data["temp_bytes"]
                        + data["code_bytes"])
    # the LoRA slot flags of `serve`: 2 slots x rank 8 of every projection, float32 (q, o: 128 <-> 128;
    # k, v: 128 -> 2 x 32 heads; gate, up: 128 -> 256; down: 256 -> 128)
    assert cli.main(["plan", str(config), "--target", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens",
                     "32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--json", "-"]) == 0
    lora = json.loads(capsys.readouterr().out)
    per_layer = (2 * 256 + 2 * (128 + 64) + 3 * (128 + 256)) * 2 * 8 * 4
    assert data["lora_bytes"] == 0 and lora["lora_bytes"] == 2 * per_layer
    assert math.isclose(lora["total_bytes"], lora["weight_bytes"] + lora["lora_bytes"] + lora["kv_pool_bytes"]
                        + lora["temp_bytes"] + lora["code_bytes"])


class _Recorder:
    """A plan.CompileProgress that records what it hears, and from which thread."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def start(self, layout, programs, layers, model_layers):
        self.events.append(("start", layout, list(programs), layers, model_layers))

    def compiled(self, program, seconds):
        self.events.append(("compiled", program, seconds, threading.current_thread() is threading.main_thread()))


def test_progress_hears_each_compiled_program_once_with_its_time():
    """Compiling 2 of 4 layers: the serving programs plus the forward 1 layer deep (the per-layer
    collectives), announced before any compiles, each then reported once from its compiling
    thread with a positive time."""
    recorder = _Recorder()
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
    plan = plan_deployment(_config(num_hidden_layers=4), parse_target("tpu-v6e:1x1"), make_layout("tp", 1), engine,
                           "bfloat16", compile_layers=2, progress=recorder)
    (start, *done) = recorder.events
    assert start[0] == "start" and start[1] == plan.layout == "tp dp=1 tp=1" and start[3:] == (2, 4)
    serving = list(plan.program_temps)  # the decode and largest forwards, the widest sampler
    assert serving == ["forward T=16 S=8", "forward T=32 S=8", "sample S=8 H=1000"] and plan.programs_compiled == 3
    assert start[2] == serving + ["forward T=16 S=8 at 1 layer (per-layer collectives)"]
    assert all(e[0] == "compiled" for e in done)
    assert sorted(e[1] for e in done) == sorted(start[2])  # once each, by name
    assert all(e[2] > 0 for e in done)
    assert not any(e[3] for e in done)  # from the compiling threads (hence a thread-safe printer)


def test_compile_printer_keeps_lines_whole_and_counts_across_threads():
    """The printer is called from the compiling threads at once: every line whole, numbered 1..N
    in the order they were printed, and the summary adds up the programs and their seconds."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    from jaxserve.planning.report import CompilePrinter

    out = io.StringIO()
    printer = CompilePrinter("tpu-v6e:2x4", layouts=2, stream=out)
    names = [f"forward T={t} S=8" for t in range(1, 41)]
    printer.start("tp dp=1 tp=8", names, 2, 36)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: printer.compiled(n, 0.5), names))
    printer.summary()
    lines = out.getvalue().splitlines()
    assert lines[0] == ("[tp dp=1 tp=8] compiling 40 programs for tpu-v6e:2x4, layout 1 of 2, 2 of 36 layers "
                        "(a forward compiles at 2 KV pool sizes): " + ", ".join(names))
    got = [re.fullmatch(r"\[tp dp=1 tp=8\] compiled (forward T=\d+ S=8) for tpu-v6e:2x4: 0\.5 s \[(\d+)/40\]", line)
           for line in lines[1:-1]]
    assert all(got) and sorted(m[1] for m in got) == sorted(names)
    assert [int(m[2]) for m in got] == list(range(1, 41))
    assert re.fullmatch(r"compiled 40 programs for 1 layout in \d+\.\d s \(wall\), 20\.0 s of compiling", lines[-1])


def test_plan_command_prints_progress_to_stderr_and_keeps_json_on_stdout(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 256}))
    assert cli.main(["plan", str(config), "--target", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens",
                     "32", "--json", "-"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # nothing else on stdout
    names = list(data["program_temps"])
    assert len(names) == data["programs_compiled"] == 3
    err = captured.err.splitlines()
    assert ("compiling 3 programs for cpu:1, layout tp dp=1 tp=1, all 2 layers (a forward compiles at 2 KV pool "
            "sizes): " + ", ".join(names)) in err
    done = [re.fullmatch(r"compiled (.+) for cpu:1: (\d+\.\d) s \[(\d)/3\]", line) for line in err]
    done = [m for m in done if m]
    assert sorted(m[1] for m in done) == sorted(names) and [m[3] for m in done] == ["1", "2", "3"]
    summary = [line for line in err if line.startswith("compiled 3 programs in ")]
    assert len(summary) == 1 and re.fullmatch(r"compiled 3 programs in \d+\.\d s \(wall\), \d+\.\d s of compiling",
                                              summary[0])
    # --sweep on 2 devices: 4 layouts, each with its start line and a line per program, prefixed with
    # the layout (8 tokens for 8 sequences: the decode forward is the largest, 2 programs each)
    assert cli.main(["plan", str(config), "--target", "cpu:2", "--sweep", "--batch", "8", "--max-num-batched-tokens",
                     "8", "--max-model-len", "128", "--json", "-"]) == 0
    captured = capsys.readouterr()
    layouts = [p["layout"] for p in json.loads(captured.out)]
    err = captured.err.splitlines()
    for layout in layouts:
        ours = [line for line in err if line.startswith(f"[{layout}] ")]
        assert len(ours) == 3 and "compiling 2 programs for cpu:2, layout " in ours[0]
        assert [re.search(r": \d+\.\d s \[(\d)/2\]$", line)[1] for line in ours[1:]] == ["1", "2"]
    assert len(layouts) == 4 and re.fullmatch(r"compiled 8 programs for 4 layouts in \d+\.\d s \(wall\), \d+\.\d s of compiling", err[-1])


@pytest.mark.parametrize("argv,message", [
    (["--target", "tpu-v9:2x2"], "unknown TPU chip 'v9'"),
    (["--target", "tpu-v6e:2x2", "--tp", "3"], "tensor-parallel size 3 does not divide the target's 4 devices"),
    (["--target", "tpu-v6e:2x4", "--tp", "8"], "TP=8 does not divide the 4 query heads"),
])
def test_plan_command_errors_name_the_problem(tmp_path, capsys, argv, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 256}))
    assert cli.main(["plan", str(config), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_command_missing_model_is_a_clean_error(capsys):
    assert cli.main(["plan", "/nonexistent/model", "--target", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plan_command_without_the_cuda_plugin_names_the_extra(tmp_path, capsys, monkeypatch):
    from jaxserve.planning import gpu_target

    # whether this environment holds jax[cuda12] or not, the command sees none
    monkeypatch.setattr(gpu_target, "cuda_plugin_installed", lambda: False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 256}))
    assert cli.main(["plan", str(config), "--target", "gpu-h100:1x1x1"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'jaxserve[gpu]'" in err and "Traceback" not in err


def test_a_copy_of_the_pool_is_measured_and_placement_noise_is_not(monkeypatch):
    """program_memory's slope: a pool of 64-wide K and V arrays on a TPU (what kv_groups.fused_kv
    avoids) is copied every step, at least one K array's page of temporaries per page; the fused
    pool serving uses is not, and its two compiles' small differences do not read as a copy."""
    from jaxserve.model import kv_cache
    from jaxserve.model.attention import make_attention
    from jaxserve.parallel.sharding import Placement
    from jaxserve.planning.compiled_memory import program_memory

    cfg = _config(num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    placement = Placement(make_mesh(1, 1, parse_target("tpu-v6e:1x1").devices()), make_layout("tp", 1).rules)
    measure = lambda: program_memory(Program("forward", tokens=64, rows=8), cfg, engine, placement,  # noqa: E731
                                     "bfloat16", make_attention("auto", cfg, placement))
    fused = measure()
    # one [16, 4, 128] row per layer: K and V of 4 heads of 64 side by side, no padding
    assert fused.page_bytes == cfg.num_layers * engine.page_size * 4 * 128 * 2 and fused.temp_per_page == 0
    monkeypatch.setattr(kv_cache, "fused_kv", lambda head_dim, platform: False)
    monkeypatch.setattr(kv_cache, "pool_head_dim", lambda head_dim, platform, latent=False: head_dim)
    narrow = measure()
    assert narrow.temp_per_page >= narrow.page_bytes / (2 * cfg.num_layers)


def test_a_shallow_compile_of_a_mixed_stack_keeps_its_layer_kinds():
    """Gemma 3 27B opens with five sliding layers: a 2-layer compile takes a sliding and a full one, so
    the planner compiles two KV layer groups writing one pool array, as serving runs them; GLM-4.5
    keeps its dense first layer beside a sparse one."""
    from pathlib import Path

    from jaxserve.planning.compiled_memory import _with_layers

    configs = Path(__file__).parents[1] / "scripts" / "model_configs"
    gemma = _with_layers(ModelConfig.from_hf(configs / "gemma-3-27b.json"), 2)
    assert gemma.layer_windows == (1024, None) and gemma.kv_groups.num_groups == 2
    assert gemma.kv_groups.num_arrays == 1
    glm = _with_layers(ModelConfig.from_hf(configs / "glm-4.5-air.json"), 2)
    assert glm.moe.layers == (False, True)
