"""The persistent batch rows (runner/batch_rows.py) against a from-scratch rebuild of every step
(tests/step_inputs_oracle.py): random workloads of admissions, appends, stops, aborts, consumer
finishes, preemptions (recompute and swap through a host tier), n > 1 forks, LoRA adapters, PD page
imports, and speculative steps whose drafts are accepted or rejected, with penalties, logit biases,
min_tokens bans and per-request seeds; driven synchronously and asynchronously as the engine does.
Host only: a real Scheduler and PageAllocator, sampled ids drawn at random."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.core.config import EngineConfig
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import SampledRows, StepPlan, SwapCosts
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.scheduler import Scheduler
from jaxserve.runner.sampler import count_in_flight
from jaxserve.runner.step_inputs import StepInputBuilder
from jaxserve.speculative.config import SpeculativeConfig
from step_inputs_oracle import rebuild

VOCAB = 24
EOS = 0


def table_map(sampling, row: int) -> dict[int, tuple[int, bool, float]]:
    """A row's penalty table as id -> (output count, seen, bias), neutral entries left out (their
    place in the row and the table's padded width do not change what the sampler does)."""
    out = {}
    for j, token in enumerate(sampling.table_ids[row].tolist()):
        entry = (int(sampling.table_output_counts[row, j]), bool(sampling.table_seen[row, j]),
                 float(sampling.table_bias[row, j]))
        if token >= 0 and entry != (0, False, 0.0):
            out[token] = entry
    return out


def on_device(sampling, prev_ids: np.ndarray):
    """What the sampler works with: the tables with the in-flight tokens counted (count_in_flight)."""
    if not sampling.needs_history:
        return sampling
    return sampling._replace(**{k: np.asarray(v) for k, v in count_in_flight(sampling, prev_ids)._asdict().items()
                                if k.startswith("table_")})


def assert_same_step(got, want, prev_ids: np.ndarray) -> None:
    assert got.num_samples == want.num_samples
    for name, a, b in zip(got.arrays._fields, got.arrays, want.arrays):
        if b is None:
            assert a is None, name
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(got.copies, want.copies)
    for name in got.sampling._fields:
        if not name.startswith("table_") and name != "pending_row":
            np.testing.assert_array_equal(getattr(got.sampling, name), getattr(want.sampling, name), err_msg=name)
    device = on_device(got.sampling, prev_ids)
    for row in range(got.sampling.num_rows):
        assert table_map(device, row) == table_map(want.sampling, row), f"penalty table of row {row}"
    # the persistent width may only exceed the rebuild's through neutral entries
    assert got.sampling.needs_history == want.sampling.needs_history


def random_params(rng: random.Random, spec: bool) -> SamplingParams:
    kind = rng.randrange(6)
    max_tokens = rng.randint(1, 12)
    return SamplingParams(
        n=1 if spec else rng.choice([1, 1, 2, 3]), max_tokens=max_tokens, seed=rng.randrange(1 << 40),
        temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 5]),
        presence_penalty=0.5 if kind in (1, 4) else 0.0, frequency_penalty=0.3 if kind == 1 else 0.0,
        repetition_penalty=1.3 if kind in (2, 4) else 1.0,
        logit_bias={rng.randrange(VOCAB): rng.choice([-2.0, 1.5]) for _ in range(rng.randint(1, 3))} if kind == 3 else None,
        min_tokens=rng.choice([0, 0, 2, max_tokens]), stop_token_ids=[rng.randrange(1, VOCAB)] if kind == 5 else [],
        logprobs=rng.choice([None, 0, 2]))


class Driver:
    def __init__(self, seed: int, async_mode: bool, spec: bool, lora: bool, host_pages: int,
                 windows: tuple = (None,)) -> None:
        self.rng = random.Random(seed)
        self.async_mode = async_mode
        num_pages = self.rng.randint(10, 24) * len(windows)
        self.cfg = EngineConfig(
            page_size=4, num_kv_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40,
            token_buckets=(16,), seq_buckets=(4,), model_id="m", enable_prefix_caching=True,
            speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
            if spec else None, enable_lora=lora, max_loras=2)
        self.s = Scheduler(self.cfg, PageAllocator(num_pages, 4, True, host_pages, windows))
        self.s.swap_costs = SwapCosts(1.0, 0.0)  # swap whenever a host tier can hold the pages
        self.builder = StepInputBuilder(self.cfg, num_pages, VOCAB, num_groups=len(windows))
        self.inflight: StepPlan | None = None
        self.samples: dict[int, SampledRows] = {}  # id(plan) -> what the device sampled, drawn at dispatch
        self.ids: list[str] = []
        self.steps = 0
        self.pending_rows = 0  # penalty rows whose last token was counted on the device

    def submit(self, k: int) -> None:
        rng = self.rng
        prefix = [3, 5, 7, 3, 5, 7, 3, 5]  # shared and repetitive: prefix hits, n-gram proposals
        prompt = prefix[:rng.randint(0, 8)] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))]
        params = random_params(rng, self.cfg.speculative_config is not None)
        lora = rng.choice([None, "a", "b", "c"]) if self.cfg.enable_lora else None
        try:
            self.s.add(Request(f"r{k}", prompt, params, eos_token_ids=frozenset({EOS}), lora_name=lora,
                               arrival_time=float(k)))
        except ValueError:
            return
        self.ids.append(f"r{k}")

    def pd_import(self) -> None:
        """A prefill instance's pages of the shared prefix land in the prefix cache."""
        tokens = [3, 5, 7, 3, 5, 7, 3, 5]
        self.s.allocator.import_pages(tokens, self.s.namespace(None, None), 2)

    def sampled(self, plan: StepPlan) -> SampledRows:
        return self.samples.pop(id(plan))

    def draw(self, plan: StepPlan) -> None:
        out = []
        for c in plan.chunks:
            for j in range(c.num_sample_rows):  # a draft is accepted half the time
                accept = j < len(c.draft_token_ids) and self.rng.random() < 0.5
                out.append(c.draft_token_ids[j] if accept else self.rng.randrange(VOCAB))
        n = len(out)  # logprobs for the rows that ask (their values do not matter here)
        self.samples[id(plan)] = SampledRows(out, [0.0] * n, [[0] * 4] * n, [[0.0] * 4] * n)

    def step(self) -> None:
        prev = self.inflight
        if prev is not None and (self.s.speculation_active() or prev.has_drafts):
            self.s.update(prev, self.sampled(prev))  # what EngineCore.step does
            prev = self.inflight = None
        plan = self.s.schedule()
        if plan.chunks:
            prev_ids = np.zeros(64, np.int32)  # the previous step's sampled ids, on the device
            in_flight = {}
            if prev is not None:
                drawn = self.samples[id(prev)]
                prev_ids[:len(drawn)] = drawn.token_ids
                # no drafts in flight: one row per sampling chunk
                in_flight = dict(zip([c.seq_id for c in prev.chunks if c.sample], drawn.token_ids))
            want = rebuild(self.builder, plan, prev, in_flight)  # before the build: it reads the same live state
            got = self.builder.build(plan, prev)
            assert_same_step(got, want, prev_ids)
            self.pending_rows += int((got.sampling.pending_row >= 0).sum())
            self.steps += 1
            self.draw(plan)
        if not self.async_mode:
            if plan.chunks:
                self.s.update(plan, self.sampled(plan))
            return
        self.inflight = plan if plan.chunks else None
        if prev is not None:
            self.s.update(prev, self.sampled(prev))

    def run(self, ops: int) -> None:
        for k in range(ops):
            op = self.rng.random()
            if op < 0.3:
                self.submit(k)
            elif op < 0.36 and self.ids:
                self.s.abort(self.rng.choice(self.ids))
            elif op < 0.42 and self.ids:
                self.s.finish(self.rng.choice(self.ids), self.rng.choice([None, 0, 1]))
            elif op < 0.45:
                self.pd_import()
            else:
                self.step()
        for _ in range(2000):
            if not (self.s.has_work() or self.inflight is not None):
                break
            self.step()
        assert not self.s.has_work()


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("host_pages", [0, 12], ids=["no-host-tier", "host-tier"])
@pytest.mark.parametrize("seed", range(6))
def test_persistent_rows_equal_a_rebuild_over_random_workloads(seed, async_mode, host_pages):
    d = Driver(seed, async_mode, spec=False, lora=seed % 2 == 1, host_pages=host_pages)
    d.run(160)
    assert d.steps > 20
    assert (d.pending_rows > 0) == async_mode
    assert len(d.builder.rows) == 0 or all(s.status.value == "finished" for s in d.builder.rows.slot_of)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_persistent_rows_equal_a_rebuild_with_sliding_layer_groups(seed, async_mode):
    """A full and a sliding group (window 6): each group's table in its columns, the sliding one's
    entries behind the window left stale in both (no attention reads them)."""
    d = Driver(200 + seed, async_mode, spec=seed % 2 == 1, lora=False, host_pages=12 * (seed // 2), windows=(None, 6))
    d.run(160)
    assert d.steps > 20
    assert d.s.allocator.num_free_pages == d.s.allocator.num_pages


@pytest.mark.parametrize("seed", range(6))
def test_persistent_rows_equal_a_rebuild_with_speculative_drafts(seed):
    d = Driver(100 + seed, async_mode=True, spec=True, lora=False, host_pages=0)
    d.run(160)
    assert d.s.spec_stats.num_drafts > 0


def test_preemption_and_rows_left_over_are_released():
    """Every row of a sequence that left the batch is freed by a later plan: a long run never holds
    more rows than max_num_seqs plus the ones that left during the last step."""
    d = Driver(7, async_mode=True, spec=False, lora=False, host_pages=0)
    held = []
    real = d.builder.build

    def build(plan, prev=None):
        out = real(plan, prev)
        held.append(len(d.builder.rows))
        return out
    d.builder.build = build
    d.run(300)
    assert d.s.stats().num_preemptions > 0 or max(held) <= d.cfg.max_num_seqs
    assert max(held) <= 2 * d.cfg.max_num_seqs
    assert len(d.builder.rows.penalty) <= 2 * 64  # slots are reused, the table never grew past doubling
