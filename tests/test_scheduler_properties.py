"""Property test: random submit / abort / finish / step sequences against the scheduler + allocator,
with a deterministic stand-in for the model (token = function of (seq_id, position)).

Driven synchronously (schedule n, update n) or asynchronously as the engine does (schedule n+1
while step n is in flight, then update n; a "sync" op finishes the step in flight first). A
simulated device pool runs every step when it is dispatched, in order: page copies, then each
chunk's K/V writes (an in-flight token is written as the id the device sampled), then every chunk
reads its whole context back and must find its own tokens -- so a page reused while an earlier
step still wrote into it, or a prefix-cache page whose content does not match its tokens, fails.

After every step: allocator invariants, token budget, seq limit, every chunk computes exactly the
next tokens of its sequence into pages only it holds, and every sampled token yields exactly one
event unless its sample had already finished. At the end: every sample finished exactly once,
nothing lost or duplicated, all pages back, and every sample's output equals its run-alone output.
"""

import dataclasses
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core.config import EngineConfig
from jaxserve.core.kv_groups import max_tokens
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import PENDING_TOKEN, SampledRows, StepPlan, SwapCosts
from jaxserve.engine.scheduler import Scheduler

EOS = 0
MAX_MODEL_LEN = 48
PREFIXES = [[(p * 37 + i * 11) % 19 + 1 for i in range(16)] for p in range(2)]


def model(seq_id: str, position: int) -> int:
    return zlib.crc32(f"{seq_id}:{position}".encode()) % 40  # EOS (0) about once in 40 tokens


@dataclasses.dataclass(frozen=True)
class Setup:
    page_size: int
    num_pages: int
    max_num_seqs: int
    budget: int
    policy: str
    caching: bool
    host_pages: int = 0   # a host KV tier (page_allocator.py): evicted cached pages demoted there
    swap: bool = True     # preemption with a host tier: swap (keep the pages) or recompute
    windows: tuple = (None,)  # KV layer groups' windows (kv_groups.py): sliding ones release pages


def make(setup: Setup, num_pages: int | None = None, max_model_len: int = MAX_MODEL_LEN) -> Scheduler:
    pages = num_pages or setup.num_pages
    cfg = EngineConfig(page_size=setup.page_size, num_kv_pages=pages, max_num_seqs=setup.max_num_seqs,
                       max_num_batched_tokens=setup.budget, max_model_len=max_model_len,
                       enable_prefix_caching=setup.caching, scheduling_policy=setup.policy, model_id="m")
    s = Scheduler(cfg, PageAllocator(pages, setup.page_size, setup.caching, setup.host_pages, setup.windows))
    s.swap_costs = SwapCosts(1.0, 0.0) if setup.swap else SwapCosts(0.0, 1.0)
    return s


def run_alone(setup: Setup, request: Request) -> dict[int, list[int]]:
    """Outputs of `request` alone on a pool too large to preempt, at the same context limit."""
    limit = max_tokens(setup.windows, setup.num_pages, setup.page_size, setup.budget, MAX_MODEL_LEN)
    s = make(dataclasses.replace(setup, max_num_seqs=4, budget=64), num_pages=256, max_model_len=limit)
    s.add(dataclasses.replace(request))
    out: dict[int, list[int]] = {}
    for _ in range(500):
        if not s.has_work():
            return out
        plan = s.schedule()
        for e in s.update(plan, SampledRows([model(c.seq_id, c.start_pos + len(c.token_ids))
                                             for c in plan.chunks if c.sample])):
            out.setdefault(e.sample_index, []).append(e.token_id)
    raise AssertionError("run-alone did not finish")


class Harness:
    """Drives a Scheduler and keeps an independent shadow of what every sample has emitted."""

    def __init__(self, setup: Setup, async_mode: bool = False, steady: bool = True) -> None:
        self.setup = setup
        self.async_mode = async_mode
        self.s = make(setup)
        self.s.steady_decodes = steady
        # what each step planned and emitted, row order aside (test_steady_decodes_...)
        self.history: list[tuple] = []
        self.steady_rows = 0  # rows planned as DecodeRows
        self.requests: dict[str, Request] = {}
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.terminal: dict[tuple[str, int], list[FinishReason]] = {}
        self.cut: set[tuple[str, int]] = set()  # finish()ed by the caller: output may stop early
        self.cut_requested: set[tuple[str, int]] = set()  # applied by the next schedule()
        self.cut_applied: set[tuple[str, int]] = set()
        self.inflight: StepPlan | None = None  # async: dispatched, not yet updated
        self.pool: dict[int, list[int | None]] = {}  # simulated device: page -> token whose K/V each slot holds
        self.host_pool: dict[int, list[int | None]] = {}  # simulated host tier: slot -> the same
        # context limit (max_tokens None): what the pool holds of one sequence (kv_groups.max_tokens)
        self.limit = max_tokens(setup.windows, setup.num_pages, setup.page_size, setup.budget, MAX_MODEL_LEN)

    def submit(self, request: Request) -> None:
        total = len(request.prompt_token_ids) + (request.params.max_tokens or 1)
        fits = total <= self.limit and request.params.n <= self.setup.max_num_seqs
        try:
            self.s.add(request)
        except ValueError:
            assert not fits, f"rejected a request that fits: {request}"
            return
        assert fits, f"accepted a request that can never fit: {request}"
        self.requests[request.request_id] = request
        for i in range(request.params.n):
            self.outputs[(request.request_id, i)] = []
            self.terminal[(request.request_id, i)] = []

    def finish(self, request_id: str, sample_index: int | None) -> None:
        self.s.finish(request_id, sample_index)
        n = self.requests[request_id].params.n
        for i in range(n) if sample_index is None else [sample_index]:
            if i < n:
                self.cut.add((request_id, i))
                self.cut_requested.add((request_id, i))

    def has_work(self) -> bool:
        return self.s.has_work() or self.inflight is not None

    def sync(self) -> None:
        """Finishes the step in flight (what the engine does before a step with penalty rows)."""
        if self.inflight is not None:
            plan, self.inflight = self.inflight, None
            self.update(plan)

    def step(self) -> None:
        s, alloc, ps = self.s, self.s.allocator, self.setup.page_size
        plan = s.schedule()
        self.cut_applied |= self.cut_requested
        self.cut_requested = set()
        alloc.check_invariants()
        in_flight = {c.seq_id for c in self.inflight.chunks if c.sample} if self.inflight else set()
        assert plan.num_tokens == sum(len(c.token_ids) for c in plan.chunks) <= self.setup.budget
        assert s.stats().num_running <= self.setup.max_num_seqs
        lengths = [len(c.token_ids) for c in plan.chunks]
        assert lengths == sorted(lengths, key=lambda n: n != 1)  # 1-token chunks first
        assert len({c.seq_id for c in plan.chunks}) == len(plan.chunks)
        written: set[int] = set()
        for c in plan.chunks:
            key = (c.request.request_id, c.sample_index)
            assert not self.terminal[key], f"{c.seq_id} scheduled after it finished"
            full = c.request.prompt_token_ids + self.outputs[key]
            end = c.start_pos + len(c.token_ids)
            pending = int(c.seq_id in in_flight)  # its token sampled by the step in flight
            expected = full[c.start_pos:end] + [PENDING_TOKEN] * (end - max(len(full), c.start_pos))
            assert c.token_ids and c.token_ids == expected
            if end > len(full):  # a placeholder only for the one in-flight token, in a decode
                assert pending and len(c.token_ids) == 1 and end == len(full) + 1
            # the last token is sampled, never computed: a sequence sure to stop is not planned past it
            max_tokens = c.request.params.max_tokens
            assert end < (len(c.request.prompt_token_ids) + max_tokens if max_tokens else self.limit)
            assert c.output_token_ids == self.outputs[key]
            assert c.sample == (end == len(full) + pending)
            assert c.page_table == alloc.page_table(c.seq_id)
            for table in c.group_page_tables or [c.page_table]:  # every layer group's
                assert len(table) == -(-end // ps)
                for page in table[c.start_pos // ps:]:
                    assert alloc.ref_count(page) == 1, f"{c.seq_id} writes into shared page {page}"
                    assert page not in written
                    written.add(page)
        # a copy fills the mid-page a chunk starts writing into: its own private copy of a shared page
        dsts = [d for _, d in plan.copies]
        targets = {t[c.start_pos // ps] for c in plan.chunks if c.start_pos % ps for t in c.group_page_tables or [c.page_table]}
        assert len(set(dsts)) == len(dsts) and set(dsts) <= targets
        self.steady_rows += len(plan.decodes)
        self.history.append(("plan", sorted((c.seq_id, c.start_pos, tuple(c.token_ids), c.sample, c.lora_slot,
                                             tuple(tuple(t) for t in c.group_page_tables or [c.page_table]))
                                            for c in plan.chunks),
                             plan.num_tokens, plan.num_samples, plan.wants_logprobs, sorted(plan.copies),
                             plan.preempted, plan.demotions, plan.promotions, alloc.num_free_pages))
        for e in plan.finished:
            assert e.finish_reason is FinishReason.ABORT and e.token_id is None
            self.terminal[(e.request_id, e.sample_index)].append(e.finish_reason)
        self.dispatch(plan)
        if not self.async_mode:
            self.update(plan)
            return
        prev, self.inflight = self.inflight, (plan if plan.chunks else None)
        if prev is not None:
            self.update(prev)

    def dispatch(self, plan: StepPlan) -> None:
        """The simulated device runs the step now: steps run in dispatch order, as on the device."""
        ps = self.setup.page_size
        for dev, host in plan.demotions:  # host tier moves first: demotions, then promotions
            self.host_pool[host] = list(self.pool.get(dev, [None] * ps))
        for host, dev in plan.promotions:
            self.pool[dev] = list(self.host_pool[host])
        for src, dst in plan.copies:
            self.pool[dst] = list(self.pool.get(src, [None] * ps))
        for c in plan.chunks:
            for i, tok in enumerate(c.token_ids):
                pos = c.start_pos + i
                if tok == PENDING_TOKEN:  # the id the previous step sampled, read on the device
                    tok = model(c.seq_id, pos)
                for table in c.group_page_tables or [c.page_table]:
                    self.pool.setdefault(table[pos // ps], [None] * ps)[pos % ps] = tok
        for c in plan.chunks:  # attention: every chunk reads its context (cached + this step's), a
            # sliding group only its window's (from the first query's window on)
            full = c.request.prompt_token_ids + self.outputs[(c.request.request_id, c.sample_index)]
            for table, window in zip(c.group_page_tables or [c.page_table], self.setup.windows):
                for pos in range(0 if window is None else max(0, c.start_pos - window + 1), c.start_pos):
                    got = self.pool.get(table[pos // ps], [None] * ps)[pos % ps]
                    assert got == full[pos], f"{c.seq_id} reads {got} at position {pos}, wrote {full[pos]}"

    def update(self, plan: StepPlan) -> None:
        alloc = self.s.allocator
        sampled = [(c.seq_id, model(c.seq_id, c.start_pos + len(c.token_ids))) for c in plan.chunks if c.sample]
        # a token of a sample that finished (stop, abort, finish) before this update is dropped
        owner = {c.seq_id: (c.request.request_id, c.sample_index) for c in plan.chunks}
        expected = [(owner[seq_id], token) for seq_id, token in sampled
                    if not self.terminal[owner[seq_id]] and owner[seq_id] not in self.cut_applied]
        events = self.s.update(plan, SampledRows([token for _, token in sampled]))
        alloc.check_invariants()
        assert sorted(((e.request_id, e.sample_index), e.token_id) for e in events) == sorted(expected)
        self.history.append(("events", sorted(dataclasses.astuple(e) for e in events), alloc.num_free_pages,
                             len(alloc._cached)))
        for e in events:
            key = (e.request_id, e.sample_index)
            assert not self.terminal[key], f"{key} emitted after its finish"
            self.outputs[key].append(e.token_id)
            if e.finish_reason is not None:
                self.terminal[key].append(e.finish_reason)

    def drain_and_check(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        assert not self.has_work(), "scheduler did not drain (livelock)"
        alloc = self.s.allocator
        assert alloc.num_free_pages == alloc.num_pages and not alloc._tables
        for key, reasons in self.terminal.items():
            assert len(reasons) <= 1, f"{key} finished {len(reasons)} times"
            assert reasons or key in self.cut, f"{key} never finished"
        for rid, request in self.requests.items():
            alone = run_alone(self.setup, request)
            for i in range(request.params.n):
                key = (rid, i)
                got, want = self.outputs[key], alone[i]
                if key in self.cut or self.terminal[key] == [FinishReason.ABORT]:
                    assert got == want[:len(got)], f"{key}: {got} is not a prefix of {want}"
                else:
                    assert got == want, f"{key}: {got} != run-alone {want}"


setups = st.builds(
    Setup, page_size=st.sampled_from([2, 4]), num_pages=st.integers(4, 14),
    max_num_seqs=st.integers(1, 4), budget=st.integers(4, 20),
    policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(),
    host_pages=st.sampled_from([0, 0, 2, 6, 24]), swap=st.booleans(),
    windows=st.sampled_from([(None,), (None,), (None, 5), (None, 3, 3), (6,)]))

submit_ops = st.tuples(
    st.just("submit"), st.integers(0, len(PREFIXES) - 1), st.integers(0, 16),
    st.lists(st.integers(1, 39), max_size=8), st.one_of(st.none(), st.integers(1, 14)),
    st.integers(1, 3), st.sampled_from([None, "tenant"]), st.integers(0, 2), st.integers(0, 2),
    st.booleans())
ops = st.lists(st.one_of(
    submit_ops, submit_ops, submit_ops,  # weight: mostly submits and steps
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.one_of(st.none(), st.integers(0, 2))),
    st.tuples(st.just("step"), st.integers(1, 4)), st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("sync")),
), min_size=4, max_size=40)


def play(setup: Setup, operations: list[tuple], async_mode: bool = False, steady: bool = True) -> Harness:
    h = Harness(setup, async_mode, steady)
    for k, op in enumerate(operations):
        if op[0] == "submit":
            _, prefix, plen, tail, max_tokens, n, salt, priority, min_tokens, ignore_eos = op
            prompt = PREFIXES[prefix][:plen] + tail or [1]
            min_tokens = min(min_tokens, max_tokens or min_tokens)
            params = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos)
            h.submit(Request(f"r{k}", prompt, params, eos_token_ids=frozenset({EOS}), priority=priority,
                             cache_salt=salt, arrival_time=float(k)))
        elif op[0] in ("abort", "finish") and h.requests:
            rid = sorted(h.requests, key=lambda r: int(r[1:]))[op[1] % len(h.requests)]
            if op[0] == "abort":
                h.s.abort(rid)
            else:
                h.finish(rid, op[2])
        elif op[0] == "step":
            for _ in range(op[1]):
                h.step()
        elif op[0] == "sync":
            h.sync()
    h.drain_and_check()
    return h


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setup=setups, operations=ops, async_mode=st.booleans())
def test_random_workloads_keep_every_invariant(setup: Setup, operations: list[tuple], async_mode: bool) -> None:
    play(setup, operations, async_mode)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setup=setups, operations=ops, async_mode=st.booleans())
def test_steady_decodes_plan_and_emit_what_the_general_path_does(setup: Setup, operations: list[tuple],
                                                                 async_mode: bool) -> None:
    """The DecodeRows columns are a faster form of the same plan: with them on and off, every step
    schedules the same chunks (row order aside), copies, preemptions and host-tier moves, and every
    update emits the same events and leaves the same pages free and cached."""
    steady = play(setup, operations, async_mode)
    general = play(setup, operations, async_mode, steady=False)
    assert general.steady_rows == 0
    assert steady.history == general.history


def test_steady_decodes_carry_most_rows_of_a_decode_heavy_run():
    """The columns are what runs: a batch of long decodes is planned almost entirely as DecodeRows
    (a row leaves them only at a page boundary, its first decode, and its last)."""
    setup = Setup(page_size=4, num_pages=64, max_num_seqs=4, budget=16, policy="fcfs", caching=True)
    operations = [("submit", 0, 8, [i + 1], 24, 1, None, 0, 0, True) for i in range(4)] + [("step", 4)]
    for async_mode in (False, True):
        h = play(setup, operations, async_mode)
        rows = sum(len(entry[1]) for entry in h.history if entry[0] == "plan")
        assert h.steady_rows >= rows * 0.6, (h.steady_rows, rows)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_tiny_pool_preempts_and_outputs_still_match_run_alone(async_mode):
    setup = Setup(page_size=2, num_pages=8, max_num_seqs=4, budget=8, policy="fcfs", caching=True)
    operations = [("submit", i % 2, 4, [i + 1, i + 2], 8, 1 + i % 2, None, 0, 0, True) for i in range(5)]
    h = play(setup, operations, async_mode)
    assert h.s.stats().num_preemptions > 0
    assert all(len(out) == 8 for out in h.outputs.values())  # ignore_eos: everyone runs to max_tokens


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_with_a_host_tier_preempted_sequences_swap_back_in_and_match_run_alone(async_mode):
    """The same tiny pool with a host KV tier: preempted sequences' pages are demoted and promoted
    back when they resume (swap-ins counted), each read checked against what was written, and the
    outputs are those of each request run alone."""
    setup = Setup(page_size=2, num_pages=8, max_num_seqs=4, budget=8, policy="fcfs", caching=True, host_pages=16)
    operations = [("submit", i % 2, 4, [i + 1, i + 2], 8, 1 + i % 2, None, 0, 0, True) for i in range(5)]
    h = play(setup, operations, async_mode)
    stats = h.s.stats()
    assert stats.num_preemptions > 0 and stats.num_swap_preemptions > 0
    assert stats.num_swapped_in_pages > 0 and stats.num_promotions >= stats.num_swapped_in_pages
    assert all(len(out) == 8 for out in h.outputs.values())
