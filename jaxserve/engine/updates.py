"""The scheduler's other half of a step: applying what the device sampled. Tokens are appended in
plan order, stop conditions decide who finishes, full pages enter the prefix cache, finished
sequences give their pages back, and one TokenEvent per appended token goes to the engine.

A plan's steady decodes (DecodeRows) are applied by one lean loop: one token each, no drafts, no
grammar, a stop check against the sequence's stop ids that calls `Sequence.stop_reason` only when a
stop is possible, and a prefix-cache commit only when a page may have filled. The listed chunks go
through the general path (prefill commits, speculative runs, grammars).
"""

from __future__ import annotations

import collections
import logging

from jaxserve.core.request import Sequence, SequenceStatus, TokenEvent
from jaxserve.core.step_plan import DecodeRows, SampledRows, StepPlan, check_sampled

logger = logging.getLogger("jaxserve.engine.scheduler")


class Updates:
    """Mixed into Scheduler: reads and writes its allocator, queues and counters."""

    def update(self, plan: StepPlan, sampled: SampledRows) -> list[TokenEvent]:
        """Appends the sampled tokens (one per sample row, in plan order), applies stop conditions,
        frees finished sequences' pages and returns one TokenEvent per appended token. A chunk with
        drafts appends its accepted run (speculative/accept.py), stopping early where a stop condition
        holds, and its rejected drafts stop counting as computed.

        Plans are updated in the order they were scheduled. A token of a sequence that finished
        meanwhile (a stop in the previous update, an abort or finish) is discarded without an event;
        a token of a sequence preempted meanwhile is appended and emitted as usual."""
        check_sampled(plan, sampled)
        self._outstanding -= bool(plan.num_seqs)
        events: list[TokenEvent] = []
        if plan.decodes.seqs:
            self._update_decodes(plan.decodes, sampled, events)
        ids, logprobs, top_ids, top_lps = sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs
        owners, row, finished = plan.owners, len(plan.decodes), SequenceStatus.FINISHED
        for chunk in plan.listed:
            seq = owners[chunk.seq_id]
            if not chunk.sample:  # a prefill chunk: its full pages enter the prefix cache
                if seq.status is not finished:
                    self._commit(seq)
                continue
            seq.num_inflight -= 1
            first, drafts = row, chunk.draft_token_ids
            row += 1 + len(drafts)
            end = row
            if drafts:
                accepted = self.drafting.verified(seq, drafts, ids[first:row])
                if seq.status is SequenceStatus.RUNNING:
                    seq.num_computed_tokens -= len(drafts) - accepted  # rejected drafts' K/V is garbage now
                end = first + accepted + 1
            if seq.status is finished:
                self.num_discarded_tokens += end - first
                continue
            outputs, guide, request = seq.output_token_ids, seq.guide, seq.request
            want = request.params.logprobs
            for r in range(first, end):
                token = ids[r]
                outputs.append(token)
                if guide is not None:
                    guide.accept(token)
                self._commit(seq)
                reason = seq.stop_reason(token)
                events.append(TokenEvent(request.request_id, seq.sample_index, token,
                                         None if want is None else logprobs[r], _top(top_ids, top_lps, r, want),
                                         reason, len(request.prompt_token_ids), seq.num_cached_prompt_tokens))
                if reason is not None:
                    self._retire(seq)
                    break
        return events

    def _update_decodes(self, decodes: DecodeRows, sampled: SampledRows, events: list[TokenEvent]) -> None:
        """update() for the plan's steady decodes: sample rows 0..len(decodes)-1."""
        ids, logprobs, top_ids, top_lps = sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs
        finished, caching = SequenceStatus.FINISHED, self.allocator.enable_prefix_caching
        append = events.append
        for r, seq in enumerate(decodes.seqs):
            seq.num_inflight -= 1
            if seq.status is finished:
                self.num_discarded_tokens += 1
                continue
            token = ids[r]
            outputs, request = seq.output_token_ids, seq.request
            outputs.append(token)
            prompt_len = len(request.prompt_token_ids)
            known = prompt_len + len(outputs)
            if caching and known >= seq.commit_at and seq.num_computed_tokens >= seq.commit_at:
                self._commit(seq)  # (the check _commit starts with, without the call)
            reason = seq.stop_reason(token) if token in seq.stop_ids or known >= seq.max_len else None
            want = request.params.logprobs
            append(TokenEvent(request.request_id, seq.sample_index, token, None if want is None else logprobs[r],
                              _top(top_ids, top_lps, r, want) if want else None,
                              reason, prompt_len, seq.num_cached_prompt_tokens))
            if reason is not None:
                self._retire(seq)

    def _commit(self, seq: Sequence) -> None:
        """Puts seq's newly completed full pages into the prefix cache: pages whose every token is
        known and whose K/V a dispatched step computes (every scheduled step is dispatched before
        the update that commits; a reader of the page runs in a later step, after the writer).
        Sets seq.commit_at: no page completes before min(computed, known tokens) reaches it."""
        at, computed, known = seq.commit_at, seq.num_computed_tokens, seq.num_tokens
        if computed < at or known < at:
            return  # no page has filled since the last commit
        alloc = self.allocator
        if seq.status is not SequenceStatus.RUNNING or not alloc.enable_prefix_caching:
            return  # (a preempted sequence's pages are gone: has_sequence below)
        if not alloc.has_sequence(seq.seq_id):
            return
        ps = alloc.page_size
        full = min(computed, known) // ps
        done = alloc.num_committed_pages(seq.seq_id)
        if full > done:
            alloc.commit(seq.seq_id, seq.token_slice(done * ps, full * ps), done * ps)  # the new pages only
            done = alloc.num_committed_pages(seq.seq_id)
        seq.commit_at = (done + 1) * ps

    def _retire(self, seq: Sequence) -> None:
        """Finished: pages released (full ones stay in the prefix cache as evictable)."""
        if self.allocator.has_sequence(seq.seq_id):
            self.allocator.free(seq.seq_id)
        self._release_lora(seq)
        self._released.append(seq)
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:  # a preempted sequence's in-flight token stopped it
            self._waiting = collections.deque(u for u in ([s for s in unit if s is not seq] for unit in self._waiting) if u)
        seq.status = SequenceStatus.FINISHED
        if self._seqs.get(seq.seq_id) is seq:
            del self._seqs[seq.seq_id]
        request_id = seq.request.request_id
        if all(s.status is SequenceStatus.FINISHED for s in self._requests[request_id]):
            del self._requests[request_id]
            del self._order[request_id]

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1


def _top(top_ids: list[list[int]], top_lps: list[list[float]], row: int, want: int | None) -> tuple | None:
    """A sample row's `want` most likely ids and logprobs (TokenEvent.top); None for none."""
    if not want:
        return None
    ids, lps = top_ids[row], top_lps[row]
    return (ids, lps) if len(ids) == want else (ids[:want], lps[:want])
