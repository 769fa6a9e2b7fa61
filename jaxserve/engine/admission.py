"""Admission and preemption, the scheduler's half that decides who gets pages: waiting requests are
admitted in policy order (FCFS, or priority then arrival) while the step's budget, max_num_seqs and
the free pages allow, each in its prefix-cache namespace (the model, the LoRA adapter, the salt); a
sequence that cannot grow preempts the lowest-priority running one, which keeps its pages on the
host tier (swap) when moving them costs less than recomputing them, else is recomputed later.

n > 1: the prompt is computed once. Sample 0 (the leader) prefills all but the last prompt token;
then every sample gets the leader's pages by reference (`PageAllocator.fork`) and computes the last
prompt token on its own, so each sample has its own logits row and seed. The partially filled last
page is copied on write (StepPlan.copies). Prefilling n times with prefix hits would recompute the
partial last page n times and could not share pages with the same step's other samples, because
pages enter the prefix cache only once their K/V is computed (in `update`).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from jaxserve.core.request import Request, Sequence, SequenceStatus

if TYPE_CHECKING:
    from jaxserve.engine.scheduler import _Step

logger = logging.getLogger("jaxserve.engine.scheduler")  # the scheduler's log: admission is half of it


class Admission:
    """Mixed into Scheduler: reads and writes the scheduler's queues, allocator and counters."""

    def _namespace(self, request: Request) -> str:
        return self.namespace(request.lora_name, request.cache_salt)

    def namespace(self, lora_name: str | None, cache_salt: str | None) -> str:
        """Prefix-cache namespace: the model, the LoRA adapter (two adapters never share pages), the salt."""
        salt = "" if cache_salt is None else "\x01" + cache_salt
        lora = "" if lora_name is None else "\x02" + lora_name
        return f"{self.config.model_id}{lora}\x00{salt}"

    def _unit_key(self, unit: list[Sequence]) -> tuple:
        """Waiting order: arrival (FCFS), or priority then arrival; a preempted sequence keeps its
        request's arrival, so it goes back in front of later requests."""
        return self._victim_key(unit[0])

    def _victim_key(self, seq: Sequence) -> tuple:
        req = seq.request
        key = (req.arrival_time, self._order[req.request_id], seq.sample_index)
        return (req.priority, *key) if self._priority else key

    def _step_tokens(self) -> int:
        """Tokens a step may hold: the budget, or less while only small buckets are compiled."""
        limit = self.step_limit
        return self.config.max_num_batched_tokens if limit is None else min(limit[0], self.config.max_num_batched_tokens)

    def _step_seqs(self) -> int:
        """Sequences that may run: max_num_seqs, or fewer while only small buckets are compiled."""
        limit = self.step_limit
        return self.config.max_num_seqs if limit is None else min(limit[1], self.config.max_num_seqs)

    def _note_token_limit(self, budget_left: int) -> None:
        """The step limit held back tokens when it used the whole step and prompts remain."""
        if budget_left == 0 and self._step_tokens() < self.config.max_num_batched_tokens and (
                self._waiting or any(s.target_len - s.num_computed_tokens > 1 for s in self._running)):
            self.limited = "tokens"

    def _admit(self, st: _Step) -> None:
        if self._waiting_unsorted:  # a preemption, or arrivals out of order: rare
            self._waiting = collections.deque(sorted(self._waiting, key=self._unit_key))
            self._waiting_unsorted = False
        alloc = self.allocator
        while self._waiting and st.budget > 0:
            unit = self._waiting[0]
            if len(self._running) + len(unit) > self._step_seqs():
                if self._step_seqs() < self.config.max_num_seqs:
                    self.limited = "seqs"  # a bucket of more sequences is still compiling
                break
            if any(seq.num_inflight for seq in unit):
                break  # preempted while its last token was in flight: recompute once that is known
            leader = unit[0]
            namespace = self._namespace(leader.request)
            num_tokens = leader.num_tokens  # prompt (+ output when recomputing)
            if leader.prefix_keys is None or leader.prefix_keys[0] != num_tokens:
                # hashed once while the head of the line waits, not at every step it stays blocked
                leader.prefix_keys = (num_tokens, alloc.prefix_keys(leader.token_slice(0, num_tokens), namespace))
            keys = leader.prefix_keys[1]
            cached, num_cached = alloc.match_groups(keys)
            if alloc.states.num_snapshots:  # a hybrid stack: only as far as a state snapshot reaches
                leader.snapshot_cut = num_cached  # its first chunk ends (and snapshots) where the match did
                cached = alloc.states.restorable(cached, keys)
                num_cached = len(cached[0]) * alloc.page_size
                leader.snapshot_keys = keys
            assert num_cached <= leader.target_len  # the match never covers the last token
            first = min(leader.target_len - num_cached, st.budget)
            if not alloc.fits(cached, num_cached + first):
                break  # head of line waits: no skipping, so nobody starves
            lora = leader.request.lora_name
            if lora is not None and not self.lora_slots.available(lora):
                break  # every adapter slot is held by running sequences of other adapters
            if lora is not None and lora not in self.lora_slots.names and not self.lora_resident(lora):
                break  # its adapter is being read from disk (off the engine thread): admitted once in
            self._waiting.popleft()
            leader.prefix_keys = None
            alloc.open_groups(leader.seq_id, namespace, cached, keys, num_query_tokens=num_tokens)
            if alloc.states.num_snapshots and num_cached:
                alloc.states.restore(leader.seq_id, keys[num_cached // alloc.page_size - 1])
            if leader.admitted_once:  # a preempted sequence resumes: what came back from the host is a swap-in
                self._num_swapped_in_pages += sum(1 for pages in cached for p in pages if p is not None and p < 0)
            st.cache_hit_tokens += num_cached
            if not leader.admitted_once:  # a recompute keeps the first admission's figure
                leader.num_cached_prompt_tokens = num_cached
            leader.num_computed_tokens = num_cached
            for seq in unit:
                if lora is not None:
                    seq.lora_slot, load = self.lora_slots.acquire(lora)
                    if load:
                        st.plan.lora_loads.append((seq.lora_slot, lora))
                seq.status = SequenceStatus.RUNNING
                seq.admitted_once = True
                self._seqs[seq.seq_id] = seq
                self._running.append(seq)
            for seq in unit:
                if seq.fork_pending:
                    continue  # not forked yet: the leader is still prefilling the prompt
                self._maybe_fork(seq)
                self._schedule_seq(seq, st, allow_preempt=False)

    def _maybe_fork(self, leader: Sequence) -> None:
        if leader.pending_siblings and leader.num_computed_tokens == leader.num_prompt_tokens - 1:
            self._commit(leader)  # async: the prefill's update may still be pending; forks copy the keys
            leader.decode_until = 0  # its pages are shared from here: the next write copies
            for sib in leader.pending_siblings:
                self.allocator.fork(leader.seq_id, sib.seq_id)
                sib.num_computed_tokens = leader.num_computed_tokens
                sib.num_cached_prompt_tokens = leader.num_cached_prompt_tokens
                sib.fork_pending = False
            leader.pending_siblings = []

    def _tokens_that_fit(self, seq_id: str, start: int, length: int) -> int:
        """Largest m <= length whose growth fits in the free pages (0 if none); pages_to_grow is
        monotone in m, so bisect."""
        lo, hi = 0, length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.allocator.pages_to_grow(seq_id, start + mid, start) <= self.allocator.num_free_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _preempt(self, victim: Sequence, st: _Step) -> None:
        """Frees the victim's pages and sends it back to the front of the waiting queue to be
        recomputed (prompt + generated tokens prefilled again; nothing is emitted twice). A leader
        whose samples have not forked yet goes back with them."""
        if victim.seq_id in st.scheduled:  # already scheduled this step: take it back
            chunk = st.scheduled.pop(victim.seq_id)
            if chunk is None:  # a steady decode: one token, no copies
                st.plan.decodes.remove(victim)
                st.budget += 1
            else:
                st.plan.listed.remove(chunk)
                st.budget += len(chunk.token_ids)
                mine = set(self.allocator.held_pages(victim.seq_id))
                st.plan.copies = [cp for cp in st.plan.copies if cp[1] not in mine]
        unit = [victim, *victim.pending_siblings]
        for seq in unit:
            if self.allocator.has_sequence(seq.seq_id):
                if self._swap_or_recompute(seq) == "swap":
                    self.allocator.free(seq.seq_id)  # cached pages demote when evicted, return on resume
                else:
                    self.allocator.forget(seq.seq_id)
            self._release_lora(seq)
            seq.num_computed_tokens = seq.decode_until = seq.commit_at = 0
            seq.status = SequenceStatus.WAITING
            self._running.remove(seq)
            self._released.append(seq)
            st.plan.preempted.append(seq.seq_id)
        self._waiting.append(unit)  # _admit sorts the queue: it lands in front of later arrivals
        self._waiting_unsorted = True
        self._num_preemptions += 1
        st.preempted = True

    def _swap_or_recompute(self, seq: Sequence) -> str:
        """With a host KV tier: keep a preempted sequence's committed pages (they are demoted as
        the pool needs them and promoted when it resumes) when moving them out and back costs less
        than prefilling their tokens again; the rest of its tokens are recomputed either way."""
        pages = self.allocator.num_committed_pages(seq.seq_id)
        if self.swap_costs is None or not self.allocator.num_host_pages or pages == 0:
            return "recompute"
        costs, ps = self.swap_costs, self.allocator.page_size
        swap = pages * costs.move_seconds_per_page
        recompute = pages * ps * costs.recompute_seconds_per_token
        choice = "swap" if swap < recompute else "recompute"
        self._num_swap_preemptions += choice == "swap"
        logger.info("preempting %s: %s (%d full pages: ~%.2f ms to move out and back, ~%.2f ms to recompute "
                    "%d tokens)", seq.seq_id, choice, pages, swap * 1e3, recompute * 1e3, pages * ps)
        return choice
