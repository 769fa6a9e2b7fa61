"""Continuous-batching scheduler: admission, per-step token budget, stall-free chunked prefill,
preemption by recompute, FCFS or priority order. Pure Python; touches no arrays.

One step: `schedule()` -> StepPlan -> (model runs) -> `update(plan, sampled)` -> TokenEvents
(engine/updates.py). A steady decode (an output token, no drafts, no grammar, its page already its
own) is planned as a row of the plan's DecodeRows columns rather than a ScheduledChunk: at a large
batch nearly every row is one, and its host work is a few reads of the sequence.

Order inside a step: every running sequence with one token left (a decode) is scheduled first, one
token each; then running sequences still prefilling continue in the leftover budget (a long prompt
is split over steps and never holds up decodes); then waiting requests are admitted while the budget,
`max_num_seqs` and the free pages allow (none in a step that had to preempt).

n > 1 samples share the prompt's pages: admission.py says how.

Asynchronous scheduling: the engine may call `schedule()` for step n+1 before `update()` of step n
(step n still runs on the device). A sequence sampled in step n then has one in-flight token
(`Sequence.num_inflight`): its next decode is planned anyway, with `PENDING_TOKEN` standing for the
unknown id (the model runner substitutes the id sampled on the device). Stop conditions are still
decided in `update()`: a sequence that stops at step n has the token of its step-n+1 decode
discarded (no event), and one that is certain to stop by length is not planned past it. A preempted
sequence's in-flight token is still appended by `update()` (and emitted); the sequence is re-admitted
only once nothing of it is in flight, so its recompute prefills known tokens only.
Pages may be freed while a dispatched step still writes into them: device steps run in order and
nothing reads a page before writing it, so the next owner only ever sees its own K/V. A page enters
the prefix cache only when every position it covers has a known token and its K/V is computed by a
dispatched step (`_commit`), so its content always matches its key by the time a later step reads it.

Speculative decoding (`EngineConfig.speculative_config`, n-gram proposals): a decode whose last
token is known (nothing in flight) may carry d <= k draft tokens after it, d + 1 tokens computed and
d + 1 rows sampled in the same step (speculative/accept.py verifies them: the rows sampled as without
speculation, the drafts accepted while they match). Drafts need budget and free pages (a step never
preempts for them); which decodes draft and how many is speculative/drafting.py's business (including the
back-off of sequences whose proposals keep missing). `update()` emits
the accepted run token by token with the usual stop checks and rolls `num_computed_tokens` back over the rejected drafts: their K/V stays in the pages
as garbage past the sequence's length, overwritten by later steps, and never committed to the
prefix cache (commits cover known tokens only). A speculating sequence is not planned again until
its step is updated (its computed count runs ahead of its known tokens), so the engine completes a
step with drafts before planning the next.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Callable

from jaxserve.core.request import Sequence, SequenceStatus
from jaxserve.core.step_plan import PENDING_TOKEN, ScheduledChunk, StepPlan, SwapCosts
from jaxserve.engine.admission import Admission
from jaxserve.engine.inbox import Inbox
from jaxserve.engine.updates import Updates
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.scheduler_stats import SchedulerStats
from jaxserve.lora.slot_table import SlotTable
from jaxserve.speculative.drafting import Drafting
from jaxserve.speculative.stats import SpecDecodeStats

logger = logging.getLogger("jaxserve.engine.scheduler")

_CONFIG_FIELDS = ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                  "enable_prefix_caching", "scheduling_policy", "model_id")


@dataclasses.dataclass
class _Step:
    plan: StepPlan
    budget: int
    scheduled: dict[str, ScheduledChunk | None] = dataclasses.field(default_factory=dict)  # None: a DecodeRows row
    preempted: bool = False
    cache_hit_tokens: int = 0
    speculate: bool = False  # decodes of this step may carry drafts


class Scheduler(Admission, Inbox, Updates):
    def __init__(self, engine_config: Any, allocator: PageAllocator) -> None:
        for name in _CONFIG_FIELDS:
            if not hasattr(engine_config, name):
                raise ValueError(f"engine config lacks '{name}'")
        cfg = engine_config
        if cfg.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {cfg.scheduling_policy!r}")
        if cfg.page_size != allocator.page_size:
            raise ValueError(f"page_size {cfg.page_size} != allocator page size {allocator.page_size}")
        num_kv_pages = getattr(cfg, "num_kv_pages", None)
        if num_kv_pages is not None and num_kv_pages != allocator.num_pages:
            raise ValueError(f"num_kv_pages {num_kv_pages} != allocator pages {allocator.num_pages}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(cfg, name) is None or getattr(cfg, name) < 1:
                raise ValueError(f"{name} must be >= 1 (resolve unset sizes with capacity.plan_capacity), "
                                 f"got {getattr(cfg, name)}")
        self.config = cfg
        self.allocator = allocator
        self._priority = cfg.scheduling_policy == "priority"
        self._context_limit = allocator.max_tokens(cfg.max_model_len, cfg.max_num_batched_tokens)  # per sequence
        self._lock = threading.Lock()  # add/abort/finish may come from other threads
        self._incoming: list[list[Sequence]] = []
        self._removals: list[tuple[str, int | None, bool]] = []  # (request_id, sample_index, is_abort)
        self._requests: dict[str, list[Sequence]] = {}
        self._order: dict[str, int] = {}      # arrival counter: tie-break for equal arrival times
        self._next_order = 0
        self._seqs: dict[str, Sequence] = {}
        # admission units ([leader, pending siblings] or [seq]) in admission order once sorted
        self._waiting: collections.deque[list[Sequence]] = collections.deque()
        self._waiting_unsorted = False  # something joined out of order: _admit sorts first
        self._running: list[Sequence] = []
        self._num_preemptions = 0
        self._num_swap_preemptions = 0
        self._num_swapped_in_pages = 0
        self.swap_costs: SwapCosts | None = None  # set by the engine when there is a host KV tier
        # (tokens, sequences) a step may hold while only some buckets are compiled (a background
        # warm-up: runner/background_compile.py); None: the configured limits
        self.step_limit: tuple[int, int] | None = None
        self.limited: str | None = None  # what step_limit held back in the last plan: "tokens" | "seqs"
        self.num_discarded_tokens = 0  # sampled after their sequence had finished (async scheduling)
        # steady decodes planned as DecodeRows columns; False plans every one as a ScheduledChunk
        # (the same plan, row order aside: the tests' oracle for the columns)
        self.steady_decodes = True
        self._outstanding = 0  # plans with chunks scheduled and not yet updated
        self._released: list[Sequence] = []  # left the batch since the last plan with chunks (StepPlan.released)
        spec = getattr(cfg, "speculative_config", None)
        self.drafting = Drafting(spec) if spec is not None else None
        self.lora_slots = SlotTable(cfg.max_loras) if getattr(cfg, "enable_lora", False) else None
        self._lora_unloaded: list[str] = []  # adapters unloaded at run time: their slots are freed in schedule()
        # multi-LoRA: whether an adapter can be loaded into a slot without reading the disk (the
        # runner's host cache; asking starts the read on a worker thread). The engine sets it.
        self.lora_resident: Callable[[str], bool] = lambda name: True

    # ---- entry points (any thread) -------------------------------------------------------------

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._removals or self._running or self._waiting)

    def _num_waiting(self) -> int:
        """Sequences waiting for admission, just added ones included."""
        with self._lock:
            incoming = sum(len(u) for u in self._incoming)
        # any thread (the server's admission check): tuple() copies the deque in one C call, which the
        # engine thread cannot interleave with; iterating it here raised "deque mutated during iteration"
        return incoming + sum(len(u) for u in tuple(self._waiting))

    def stats(self) -> SchedulerStats:
        lora_running, lora_waiting = self._lora_counts() if self.lora_slots is not None else ({}, {})
        return SchedulerStats(
            num_running=len(self._running), num_waiting=self._num_waiting(),
            num_free_pages=self.allocator.num_free_pages, num_total_pages=self.allocator.num_pages,
            prefix_cache_queries=self.allocator.stats.queries, prefix_cache_hits=self.allocator.stats.hits,
            num_preemptions=self._num_preemptions, lora_running=dict(lora_running), lora_waiting=dict(lora_waiting),
            lora_slot_loads=self.lora_slots.num_loads if self.lora_slots is not None else 0,
            num_host_pages=self.allocator.num_host_pages, num_host_pages_used=self.allocator.num_host_pages_used,
            host_hit_tokens=self.allocator.host_hit_tokens, num_demotions=self.allocator.host.num_demotions,
            num_promotions=self.allocator.host.num_promotions, num_swap_preemptions=self._num_swap_preemptions,
            num_swapped_in_pages=self._num_swapped_in_pages)

    def _lora_counts(self) -> tuple[collections.Counter, collections.Counter]:
        """(adapter -> running sequences, adapter -> waiting ones, just added included)."""
        with self._lock:
            incoming = [s for u in self._incoming for s in u]
        waiting = [*incoming, *(s for u in self._waiting for s in u)]
        count = lambda seqs: collections.Counter(s.request.lora_name for s in seqs if s.request.lora_name)  # noqa: E731
        return count(self._running), count(waiting)

    # ---- the step (engine thread) --------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans the next step: applies queued aborts/finishes, then decodes, prefill continuations
        and admissions in that order (see the module docstring). Scheduled tokens count as computed
        from here on; their full pages enter the prefix cache in update(). At most one earlier plan
        may still await its update() (async scheduling); raises RuntimeError otherwise."""
        if self._outstanding > 1:
            raise RuntimeError(f"{self._outstanding} plans await update(); async scheduling plans one "
                               "step ahead at most")
        st = _Step(StepPlan(), self._step_tokens())
        self.allocator.states.promote()  # snapshots the last dispatched plan writes: restorable from now
        self.limited = None
        if self.drafting is not None:
            self.drafting.start_step()
        with self._lock:
            incoming, self._incoming = self._incoming, []
            removals, self._removals = self._removals, []
            unloaded, self._lora_unloaded = self._lora_unloaded, []
        for name in unloaded:
            self.lora_slots.forget(name)
        if incoming:
            keys = [self._unit_key(u) for u in incoming]
            if keys != sorted(keys) or self._waiting and self._unit_key(self._waiting[-1]) > keys[0]:
                self._waiting_unsorted = True
            self._waiting.extend(incoming)
        for request_id, sample_index, is_abort in removals:
            self._remove(request_id, sample_index, is_abort, st.plan)
        st.speculate = self.speculation_active()

        # decodes first, then prefill continuations (a second pass over those the first left)
        rest = self._schedule_decodes(st)
        self._schedule_running(rest, st)
        if not st.preempted:
            self._admit(st)
        self._note_token_limit(st.budget)

        plan = st.plan
        moves = self.allocator.drain_transfers()
        plan.demotions, plan.promotions = moves.demotions, moves.promotions
        plan.page_tables = self.allocator.tables_or_empty
        plan.state_slots = self.allocator.states.slot_of if self.allocator.states.num_slots else None
        decodes = plan.decodes
        top = -1  # the most logprob alternatives a row asks for
        for seq in decodes.seqs:
            seq.num_computed_tokens += 1
            seq.num_inflight += 1
            k = seq.request.params.logprobs
            if k is not None and k > top:
                top = k
        plan.listed.sort(key=lambda c: len(c.token_ids) != 1)  # stable: 1-token chunks first
        owners, seqs = plan.owners, self._seqs
        num_tokens = num_samples = len(decodes)
        num_drafts = 0
        for chunk in plan.listed:
            seq = owners[chunk.seq_id] = seqs[chunk.seq_id]
            n = len(chunk.token_ids)
            num_tokens += n
            seq.num_computed_tokens += n
            if chunk.draft_token_ids:
                num_drafts += len(chunk.draft_token_ids)
            if chunk.sample:
                seq.num_inflight += 1
                num_samples += chunk.num_sample_rows
                k = chunk.request.params.logprobs
                if k is not None and k > top:
                    top = k
        plan.num_tokens, plan.num_samples, plan.num_drafts = num_tokens, num_samples, num_drafts
        plan.num_top_logprobs = top
        self._outstanding += bool(plan.num_seqs)
        if plan.num_seqs:  # a plan without sequences is not run: what it would carry waits for the next
            plan.released, self._released = self._released, []
            plan.state_snapshots = self.allocator.states.register(plan.listed, owners, self.allocator.page_size)
            plan.state_copies = self.allocator.states.drain_copies()
        if logger.isEnabledFor(logging.DEBUG):
            chunks = plan.chunks
            decodes = sum(1 for c in chunks if len(c.token_ids) == 1 + len(c.draft_token_ids))
            drafts = sum(len(c.draft_token_ids) for c in chunks)
            logger.debug("step: running=%d waiting=%d tokens=%d (decode %d, draft %d, prefill %d) preempted=%d "
                         "cache_hit_tokens=%d free_pages=%d", len(self._running),
                         sum(len(u) for u in self._waiting), plan.num_tokens, decodes, drafts,
                         plan.num_tokens - decodes - drafts, len(plan.preempted), st.cache_hit_tokens,
                         self.allocator.num_free_pages)
        return plan

    def speculation_active(self) -> bool:
        """Whether the next step's decodes may carry drafts (speculative/drafting.py)."""
        if self.drafting is None:
            return False
        return self.drafting.active(self._running, len(self._running) + self._num_waiting())

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        return self.drafting.stats if self.drafting is not None else None

    # ---- admission and limits ------------------------------------------------------------------

    def _schedule_decodes(self, st: _Step) -> list[Sequence]:
        """Schedules, in running order while the budget lasts, every running sequence whose next
        chunk is one token; returns the others (and those the budget left). A steady decode (an
        output token, no drafts, no grammar, its page held and private) becomes a DecodeRows row
        through a few reads of the sequence; the rest go through _schedule_seq."""
        rest: list[Sequence] = []
        seqs = self._running[:]
        scheduled, running, d = st.scheduled, SequenceStatus.RUNNING, st.plan.decodes
        alloc = self.allocator
        steady, windows = self.steady_decodes and not st.speculate, alloc.has_windows
        for i, seq in enumerate(seqs):
            if st.budget == 0:
                return rest + seqs[i:]
            if seq.status is not running or seq.fork_pending or seq.seq_id in scheduled:
                rest.append(seq)
                continue
            inflight, start, outputs = seq.num_inflight, seq.num_computed_tokens, seq.output_token_ids
            prompt_len = len(seq.request.prompt_token_ids)
            known = prompt_len + len(outputs)
            if inflight and known + inflight >= seq.max_len:
                continue  # its in-flight token ends it by length: nothing more to compute
            if seq.pending_siblings:
                self._maybe_fork(seq)
                if seq.target_len - seq.num_computed_tokens != 1:
                    rest.append(seq)
                    continue
            elif known + inflight - start != 1:
                rest.append(seq)  # a prefill continuation
                continue
            if steady and inflight <= 1 and start >= prompt_len and seq.guide is None:
                if windows:  # pages a sliding window left go back to the pool, cached first
                    self._commit(seq)
                    alloc.release_window(seq.seq_id, start)
                if not (start < seq.decode_until or self._page_held(seq, start)):
                    self._schedule_seq(seq, st, allow_preempt=True)
                    continue
                scheduled[seq.seq_id] = None  # a DecodeRows row
                d.seqs.append(seq)
                d.positions.append(start)
                d.token_ids.append(PENDING_TOKEN if inflight else outputs[-1])
                d.num_outputs.append(start + 1 - prompt_len)
                st.budget -= 1
            else:
                self._schedule_seq(seq, st, allow_preempt=True)
        return rest

    def _page_held(self, seq: Sequence, position: int) -> bool:
        """Whether the page under `position` is held and private to seq (remembered until the
        page's end: PageAllocator.writable)."""
        if not self.allocator.writable(seq.seq_id, position):
            return False
        ps = self.allocator.page_size
        seq.decode_until = (position // ps + 1) * ps
        return True

    def _schedule_running(self, seqs: list[Sequence], st: _Step) -> None:
        """Schedules the prefill continuations of `seqs` in order while the budget lasts (a
        decode pass ran first: a fork or a preemption since may have changed who is what)."""
        scheduled, running = st.scheduled, SequenceStatus.RUNNING
        for seq in seqs:
            if st.budget == 0:
                return
            if seq.status is not running or seq.fork_pending or seq.seq_id in scheduled:
                continue
            if seq.num_inflight and seq.num_tokens + seq.num_inflight >= seq.max_len:
                continue  # its in-flight token ends it by length: nothing more to compute
            if seq.pending_siblings:
                self._maybe_fork(seq)
            if seq.target_len - seq.num_computed_tokens != 1:
                self._schedule_seq(seq, st, allow_preempt=True)

    def _schedule_seq(self, seq: Sequence, st: _Step, allow_preempt: bool) -> None:
        """Schedules seq's next chunk within the budget, growing its pages; when the pool is dry a
        prefill chunk shrinks to what fits, and otherwise (allow_preempt) victims are preempted."""
        alloc = self.allocator
        start = seq.num_computed_tokens
        length = min(seq.target_len - start, st.budget)
        if length <= 0:
            return
        if alloc.states.num_snapshots:  # a hybrid's prefill chunks end on page boundaries (state snapshots)
            length = alloc.states.snapshot_length(start, length, alloc.page_size, seq.snapshot_cut)
        if alloc.has_windows:  # pages a sliding window left go back to the pool, cached first
            self._commit(seq)
            alloc.release_window(seq.seq_id, start)
        drafts = self.drafting.drafts(seq, st.budget) if st.speculate and length == 1 else []
        if length == 1 and not drafts and alloc.writable(seq.seq_id, start):
            copies = ()  # the usual decode: its page is its own and covers the token
        else:
            if drafts and alloc.pages_to_grow(seq.seq_id, start + 1 + len(drafts), start) > alloc.num_free_pages:
                drafts = []  # speculation never takes the last pages, nor preempts anyone
            length += len(drafts)
            while alloc.pages_to_grow(seq.seq_id, start + length, start) > alloc.num_free_pages:
                fit = self._tokens_that_fit(seq.seq_id, start, length)
                if fit > 0:
                    length = fit
                    break
                if not allow_preempt:
                    return
                victim = max((s for s in self._running if not s.fork_pending), key=self._victim_key)
                self._preempt(victim, st)
                if victim is seq:
                    return
            copies = alloc.grow(seq.seq_id, start + length, start)
        num_tokens = seq.num_tokens
        stop = start + length - len(drafts)  # the drafts come after the sequence's last token
        if stop > num_tokens:  # the token sampled by the step in flight: only ever a 1-token decode
            assert length == 1 and stop == num_tokens + 1 and seq.num_inflight, (seq.seq_id, start, length)
            token_ids = [PENDING_TOKEN]
        else:
            token_ids = seq.token_slice(start, stop)
        tables = alloc.page_tables(seq.seq_id)
        chunk = ScheduledChunk(seq.seq_id, seq.request, seq.sample_index, token_ids + drafts if drafts else token_ids,
                               start, tables[0], stop == num_tokens + seq.num_inflight, seq.output_token_ids,
                               seq.lora_slot, drafts, tables if len(tables) > 1 else [])
        st.plan.listed.append(chunk)
        if copies:
            st.plan.copies.extend(copies)
        st.scheduled[seq.seq_id] = chunk
        st.budget -= length

    def set_drafts(self, plan: StepPlan, proposals: list[list[int]]) -> None:
        """Fills the DRAFT_SLOTs of the plan's chunks with the draft's proposals (Drafting.fill_slots)."""
        Drafting.fill_slots(plan, proposals)
