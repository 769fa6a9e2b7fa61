"""A background warm-up (`--warmup background`): the engine serves once the smallest bucket is compiled,
the other buckets compile on a thread, and steps only ever take compiled buckets, so requests of
every size are answered exactly as a fully warmed engine answers them and nothing compiles on the
serving thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine_utils import SMALL_ENGINE, greedy, run_all, tiny_model
from jaxserve.core.buckets import declared_buckets, serving_programs
from jaxserve.core.config import EngineConfig
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine_core import EngineCore
from jaxserve.parallel.sharding import make_mesh
from jaxserve.runner.background_compile import BucketCompiler, bucket_programs, first_programs

# three token buckets x two sequence buckets: several buckets left for the background
ENGINE = dict(SMALL_ENGINE, max_num_seqs=8, seq_buckets=(2, 8), token_buckets=(4, 8, 32))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("bg"))
    return cfg, weights


def _requests() -> list[Request]:
    """Prompts of 3 to 40 tokens (one needs chunks of the largest bucket), 8 at once, some with
    penalties (a sampler with a history table)."""
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate((3, 40, 7, 12, 5, 25, 9, 2)):
        params = greedy(6) if i % 3 else SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                        repetition_penalty=1.3)
        out.append(Request(f"r{i}", rng.integers(3, 90, size=n).tolist(), params))
    return out


def test_requests_of_every_size_are_answered_while_buckets_compile(model, monkeypatch):
    cfg, weights = model
    full = EngineCore(cfg, weights, EngineConfig(**ENGINE), make_mesh(1, 1))
    full.runner.warmup()
    expected = run_all(full, _requests())

    core = EngineCore(cfg, weights, EngineConfig(**ENGINE, warmup="background"), make_mesh(1, 1))
    runner = core.runner
    gate = threading.Event()  # holds the background thread after its first bucket
    real_compile = None

    def compile_slowly(program):
        gate.wait(60)
        real_compile(program)

    original = BucketCompiler.__init__

    def patched(self, programs, compiled, compile_one, on_ready):
        nonlocal real_compile
        real_compile = compile_one
        original(self, programs, compiled, compile_slowly, on_ready)

    monkeypatch.setattr(BucketCompiler, "__init__", patched)
    runner.warmup(background=True)
    monkeypatch.undo()
    programs = serving_programs(core.engine_cfg, cfg)
    smallest = min(declared_buckets(core.engine_cfg))
    assert runner.programs_declared == len(programs)
    assert runner.programs_compiled == len(first_programs(programs)) < len(programs)
    assert runner.step_limit == smallest and runner.builder.buckets == [smallest]

    # While nothing else is compiled, every request is served on the smallest bucket.
    seen = []
    got = run_all(core, _requests(), on_step=lambda: seen.append(runner.step_limit))
    assert got == expected
    assert set(seen) == {smallest} and core.scheduler.limited in ("tokens", "seqs", None)
    assert runner.compilations_after_warmup == 0
    assert runner.background.pressure in ("tokens", "seqs")  # the limit held steps back

    gate.set()
    assert runner.background.wait(600) and runner.background.failed is None
    assert runner.programs_compiled == runner.programs_declared
    assert sorted(runner.builder.buckets) == sorted(declared_buckets(core.engine_cfg))
    # Every bucket now serves, from programs compiled on the other thread: still nothing compiles here.
    again = run_all(core, [Request(f"again-{r.request_id}", r.prompt_token_ids, r.params) for r in _requests()])
    assert {k[len("again-"):]: v for k, v in again.items()} == expected
    assert runner.compilations_after_warmup == 0


def test_the_largest_ready_bucket_is_the_limit_and_traffic_picks_what_compiles_next():
    from jaxserve.core.buckets import Program

    programs = [Program("forward", t, s) for t, s in ((4, 2), (8, 2), (8, 8), (32, 2), (32, 8))]
    programs += [Program("sample", rows=s, history=h) for s in (2, 8) for h in (0, 64)] + [Program("copy")]
    by_bucket = bucket_programs(programs)
    assert by_bucket[(8, 8)] == [Program("forward", 8, 8), Program("sample", rows=8), Program("sample", rows=8,
                                                                                                  history=64)]
    first = first_programs(programs)
    assert first == [Program("forward", 4, 2), Program("sample", rows=2), Program("sample", rows=2, history=64),
                     Program("copy")]
    order = []
    compiler = BucketCompiler(programs, first, order.append, lambda ready: None)
    assert compiler.limit() == (4, 2)
    compiler.pressure = "seqs"
    assert compiler._next() == (8, 8)  # grows the sequences, the cheapest such bucket
    compiler.pressure = "tokens"
    assert compiler._next() == (8, 2)
    compiler.pressure = None
    compiler.start()
    assert compiler.wait(10) and compiler.num_compiled == len(programs)
    assert [p for p in order if p.kind == "forward"] == [Program("forward", 8, 2), Program("forward", 8, 8),
                                                          Program("forward", 32, 2), Program("forward", 32, 8)]
    assert compiler.limit() == (32, 8)
