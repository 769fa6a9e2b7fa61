"""Serving programs kept on disk (program_store.py): a restart loads them without tracing or
lowering and serves the same tokens; a changed input or a bad entry compiles again."""

from __future__ import annotations

import logging
import sys
import threading

import jax
import jax.numpy as jnp
import pytest

from engine_utils import SMALL_ENGINE, greedy, make_core, run_all, tiny_model
from jaxserve.runner import model_runner, program_store
from jaxserve.core.buckets import serving_programs
from jaxserve.core.config import EngineConfig
from jaxserve.engine.engine_core import EngineCore
from jaxserve.runner.program_store import ProgramTable, fingerprint
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh

_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_traced = {"count": 0}
_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event in _TRACE_EVENTS:
        with _lock:
            _traced["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("model"))
    return cfg, weights


def _requests() -> list[Request]:
    return [Request(f"r{i}", list(range(3 + 7 * i, 3 + 7 * i + n)), greedy(9)) for i, n in enumerate((5, 19, 30))]


def _core(model, **overrides) -> EngineCore:
    """An engine on the tiny model, not yet warmed up."""
    return EngineCore(*model, EngineConfig(**{**SMALL_ENGINE, **overrides}), make_mesh(1, 1))


def _programs(core: EngineCore) -> int:
    return len(serving_programs(core.runner.engine_cfg, core.runner.model_cfg))


def test_a_restart_loads_every_program_without_tracing_and_serves_the_same_tokens(model, tmp_path, monkeypatch):
    monkeypatch.setattr(model_runner, "cache_directory", lambda: str(tmp_path))
    first = _core(model)
    first.runner.warmup()
    n = _programs(first)
    assert (first.runner.programs.compiled, first.runner.programs.loaded) == (n, 0)
    assert len(list((tmp_path / "jaxserve-programs").rglob("*.bin"))) == n
    expected = run_all(first, _requests())

    # a restart is a new process: forget what this one holds, so every entry is read from disk
    program_store._PROCESS_PROGRAMS.clear()
    restart = _core(model)
    before = _traced["count"]
    restart.runner.warmup()
    assert _traced["count"] == before, "a warm restart traced or lowered a program"
    assert (restart.runner.programs.compiled, restart.runner.programs.loaded) == (0, n)
    assert run_all(restart, _requests()) == expected
    assert restart.runner.compilations_after_warmup == 0
    again = _core(model)  # a second engine in the process shares the loaded programs: none read twice
    again.runner.warmup()
    assert (again.runner.programs.compiled, again.runner.programs.loaded) == (0, n)
    assert run_all(again, _requests()) == expected


def test_another_engine_config_is_another_key_and_a_bad_entry_is_compiled_again(model, tmp_path, monkeypatch,
                                                                                  caplog):
    monkeypatch.setattr(model_runner, "cache_directory", lambda: str(tmp_path))
    jax.clear_caches()  # the programs the test above ran (see below)
    first = make_core(*model)
    n = _programs(first)
    firsts = sorted((tmp_path / "jaxserve-programs").rglob("_forward_packed-*.bin"))
    other = make_core(*model, max_model_len=64)  # another config: its programs compile under their own keys
    assert (other.runner.programs.compiled, other.runner.programs.loaded) == (_programs(other), 0)
    bad = firsts[0]
    bad.write_bytes(b"not a program")
    caplog.set_level(logging.WARNING, logger="jaxserve.runner.program_store")
    # jax hands back its in-memory executable for an HLO it compiled before, and XLA:CPU cannot
    # serialize one that has run (its sort comparator is resolved at first run): start afresh
    jax.clear_caches()
    third = make_core(*model)
    assert (third.runner.programs.compiled, third.runner.programs.loaded) == (1, n - 1)
    assert any("unreadable" in r.getMessage() and bad.name in r.getMessage() for r in caplog.records)
    assert bad.read_bytes() != b"not a program"  # rewritten
    assert run_all(third, _requests()) == run_all(first, _requests())


def test_fingerprint_changes_with_the_source_the_configs_and_the_flags(tmp_path, monkeypatch):
    package = tmp_path / "jaxserve_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(program_store, "_SOURCE_PACKAGES", ("jaxserve_probe_pkg",))
    base = fingerprint("config-a")
    assert fingerprint("config-a") == base
    assert fingerprint("config-b") != base
    (package / "__init__.py").write_text("X = 2\n")
    assert fingerprint("config-a") != base
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert fingerprint("config-a") != base
    sys.modules.pop("jaxserve_probe_pkg", None)


def test_a_call_with_another_signature_falls_back_to_jit(tmp_path, caplog):
    def scaled(x, scale):
        return x * scale

    double = jax.jit(scaled, static_argnames=("scale",))
    table = ProgramTable(tmp_path, "fp", jax.devices()[:1])
    assert table.call("k", double, {"scale": 2}, (), jnp.ones(3)).tolist() == [2.0] * 3
    assert table.compiled == 1 and len(list((tmp_path / "jaxserve-programs").rglob("*.bin"))) == 1
    caplog.set_level(logging.WARNING, logger="jaxserve.runner.program_store")
    assert table.call("k", double, {"scale": 2}, (), jnp.ones(4)).tolist() == [2.0] * 4
    assert any("another signature" in r.getMessage() for r in caplog.records)
    again = ProgramTable(tmp_path, "fp", jax.devices()[:1])
    assert again.call("k", double, {"scale": 2}, (), jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
    assert (again.loaded, again.compiled) == (1, 0)
    assert ProgramTable(tmp_path, "fp", jax.devices()[:1]).call("k", double, {"scale": 3}, (), jnp.ones(3)).tolist() == [3.0] * 3


def test_a_program_served_by_jaxs_own_cache_is_not_stored(tmp_path, monkeypatch, caplog):
    """An XLA:CPU executable jax loaded from its persistent cache re-serializes into an entry that
    fails when loaded: such a compile is used but not stored."""
    def plus(x, k):
        return x + k

    hits = iter(range(100))
    monkeypatch.setattr(program_store, "_cache_hits", lambda: next(hits))  # every compile "hits"
    caplog.set_level(logging.INFO, logger="jaxserve.runner.program_store")
    table = ProgramTable(tmp_path, "fp", jax.devices()[:1])
    assert table.call("k", jax.jit(plus, static_argnames=("k",)), {"k": 1}, (), jnp.ones(2)).tolist() == [2.0, 2.0]
    assert table.compiled == 1 and not list(tmp_path.rglob("*.bin"))
    assert any("not stored" in r.getMessage() for r in caplog.records)


def test_the_stores_compiles_skip_jaxs_own_cache_write():
    """jax's entry for a store compile (a module name of the store's own) would never be read."""
    from jax._src import config as jax_config

    before = jax_config.persistent_cache_min_compile_time_secs.value
    with program_store._no_jax_cache_write():
        assert jax_config.persistent_cache_min_compile_time_secs.value == float("inf")
    assert jax_config.persistent_cache_min_compile_time_secs.value == before


def test_a_static_argument_without_a_stable_text_is_not_stored(tmp_path, caplog):
    class Opaque:  # default repr: an address, different in every process
        pass

    def ident(x, thing):
        return x

    caplog.set_level(logging.WARNING, logger="jaxserve.runner.program_store")
    table = ProgramTable(tmp_path, "fp", jax.devices()[:1])
    assert table.call("k", jax.jit(ident, static_argnames=("thing",)), {"thing": Opaque()}, (),
                      jnp.ones(2)).tolist() == [1.0, 1.0]
    assert table.compiled == 1 and not list(tmp_path.rglob("*.bin"))
    assert any("without a stable text" in r.getMessage() for r in caplog.records)


def test_unused_program_sets_are_removed_and_recent_ones_kept(tmp_path, monkeypatch):
    """A new fingerprint (an upgrade, another config) never reads the old set again: sets idle two
    weeks, or beyond the most recently used MAX_KEPT_SETS, go; the set in use and others' files stay."""
    import os
    import time

    monkeypatch.setattr(program_store, "MAX_KEPT_SETS", 2)
    store = tmp_path / "jaxserve-programs"
    now = time.time()

    def make_set(name: str, age_days: float):
        d = store / name
        d.mkdir(parents=True)
        (d / "forward_step-x.bin").write_bytes(b"\0" * 1000)
        os.utime(d, (now - age_days * 86400,) * 2)
        return d

    current = make_set("a" * 32, 30)          # in use: kept and marked used, however old
    (current / "forward_step-x.bin").unlink()  # (a table starts loading its own entries at once)
    os.utime(current, (now - 30 * 86400,) * 2)
    recent = [make_set(c * 32, age) for c, age in (("b", 1), ("c", 2))]
    third = make_set("d" * 32, 3)             # within two weeks but beyond the 2 most recent
    idle = make_set("e" * 32, 15)             # idle over two weeks
    foreign = store / "not-a-program-set"
    foreign.mkdir()
    os.utime(foreign, (now - 100 * 86400,) * 2)

    table = ProgramTable(tmp_path, "a" * 64, jax.devices()[:1])
    assert sorted(p.name for p in store.iterdir()) == sorted([current.name, *(d.name for d in recent), foreign.name])
    assert now - current.stat().st_mtime < 60
    assert not third.exists() and not idle.exists()
    assert table.loaded == 0


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_restart_loads_a_draft_models_or_eagle_heads_programs_too(tmp_path, monkeypatch, method):
    """The proposer's forwards (and its argmax / first drafts) are stored with the target's: a warm
    restart with speculative decoding traces nothing either, and proposes the same."""
    from engine_utils import make_core

    jax.clear_caches()  # executables earlier tests ran cannot be serialized (see above)
    monkeypatch.setattr(model_runner, "cache_directory", lambda: str(tmp_path / "cache"))
    if method == "draft_model":
        cfg, weights, _ = tiny_model(tmp_path / "target")
        proposer = tmp_path / "target"  # the target as its own draft, read from its directory
    else:
        from eagle3_heads import head_config, write_head

        cfg, weights, hf = tiny_model(tmp_path / "target", "llama3-gqa-tied", seed=3, num_hidden_layers=4)
        proposer = tmp_path / "head"
        write_head(proposer, head_config(hf, aux_layers=[0, 1, 3]), seed=1)
    spec = {"method": method, "model": str(proposer), "num_speculative_tokens": 3}
    requests = lambda: [Request(f"s{i}", [5, 17, 33, 8] * 3 + [5 + i], greedy(12)) for i in range(3)]  # noqa: E731
    first = make_core(cfg, weights, speculative_config=spec)
    target_programs = _programs(first)
    stored = first.runner.programs.compiled
    assert stored > target_programs and first.runner.programs.loaded == 0  # the proposer's are in the table
    assert len(list((tmp_path / "cache" / "jaxserve-programs").rglob("*.bin"))) == stored
    expected = run_all(first, requests())
    assert first.scheduler.spec_stats.num_draft_tokens > 0

    program_store._PROCESS_PROGRAMS.clear()  # a new process
    restart = EngineCore(cfg, weights, EngineConfig(**{**SMALL_ENGINE, "speculative_config": spec}), make_mesh(1, 1))
    before = _traced["count"]
    restart.runner.warmup()
    assert _traced["count"] == before, "a warm restart traced or lowered a program"
    assert (restart.runner.programs.compiled, restart.runner.programs.loaded) == (0, stored)
    assert run_all(restart, requests()) == expected
    assert restart.scheduler.spec_stats.num_draft_tokens == first.scheduler.spec_stats.num_draft_tokens
    assert restart.runner.compilations_after_warmup == 0


def test_serve_llm_and_generate_share_programs_and_request_values_change_no_key(tmp_path, monkeypatch):
    """`jaxserve serve`'s engine compiles; `LLM()` with the same sizes then loads every program and
    compiles none; `generate` keys its programs like serve whatever its --max-tokens."""
    monkeypatch.setattr(model_runner, "cache_directory", program_store.cache_directory)  # the store, as users get it
    previous = jax.config.jax_compilation_cache_dir  # the suite's, given back below
    try:
        _share(tmp_path)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def _share(tmp_path):
    from jaxserve.engine.loading import load_engine_core
    from jaxserve.entrypoints import cli, engine_args
    from jaxserve.entrypoints.llm import LLM

    sizes = ["--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "64",
             "--compilation-cache-dir", str(tmp_path)]

    def config(command, *extra):
        argv = [command, *sizes, *extra] + (["--prompt", "p"] if command == "generate" else [])
        return engine_args.engine_config(cli.build_parser().parse_args(argv), "jaxserve-tiny")

    serve_cfg = config("serve", "--warmup", "full")
    core, _, _ = load_engine_core(None, serve_cfg)
    compiled = core.runner.programs.compiled
    assert compiled == _programs(core) and core.runner.programs.loaded == 0
    llm = LLM(None, show_progress=False, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              compilation_cache_dir=str(tmp_path), warmup="full")
    assert (llm.core.runner.programs.compiled, llm.core.runner.programs.loaded) == (0, compiled)
    assert llm.core.runner.programs._dir == core.runner.programs._dir
    # request-level values and host-only settings are not part of a program's key
    fields = serve_cfg.program_fields()
    for other in (config("generate", "--max-tokens", "7"), config("generate", "--max-tokens", "300"),
                  config("serve", "--seed", "3", "--max-waiting-requests", "5", "--warmup", "background",
                         "--no-enable-prefix-caching", "--scheduling-policy", "priority")):
        assert other.program_fields() == fields
    assert config("serve", "--page-size", "8").program_fields() != fields
