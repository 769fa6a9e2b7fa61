"""The scheduler's inbox: requests added, aborted and finished from any thread (the server's event
loop, the engine thread) are queued under a lock and applied at the next schedule(), so the
scheduling itself runs on one thread without locks. Removing a leader hands its pages and role to
a surviving sample."""

from __future__ import annotations

from jaxserve.core.request import FinishReason, Request, Sequence, SequenceStatus, TokenEvent
from jaxserve.core.step_plan import StepPlan


class Inbox:
    """Mixed into Scheduler: the any-thread entry points and how a removal is applied."""

    def add(self, request: Request) -> None:
        """Queues a request. Raises ValueError for a request that could never run."""
        prompt = request.prompt_token_ids
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request.request_id!r}")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError("prompt_token_ids must hold non-negative integers")
        params = request.params
        if not isinstance(params.n, int) or params.n < 1:
            raise ValueError(f"n must be >= 1, got {params.n!r}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        max_len = self._max_len(len(prompt), params.max_tokens)
        with self._lock:
            if request.request_id in self._requests:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            seqs = [Sequence(f"{request.request_id}#{i}", request, i, max_len=max_len, fork_pending=i > 0,
                             guide=request.grammar.new_guide() if request.grammar is not None else None)
                    for i in range(params.n)]
            seqs[0].pending_siblings = seqs[1:]
            self._requests[request.request_id] = seqs
            self._order[request.request_id] = self._next_order
            self._next_order += 1
            self._incoming.append(seqs)

    def abort(self, request_id: str) -> None:
        """Removes the request at the next schedule(); each unfinished sample gets a final ABORT event
        (in StepPlan.finished). Unknown or finished ids are ignored (a late client disconnect)."""
        with self._lock:
            self._removals.append((request_id, None, True))

    def finish(self, request_id: str, sample_index: int | None = None) -> None:
        """Stops a request (or one of its samples) whose stop string was found downstream; no event.
        Tokens sampled in the step in flight are still returned by update(); drop them downstream."""
        with self._lock:
            self._removals.append((request_id, sample_index, False))

    def unload_lora(self, name: str) -> None:
        """An adapter unloaded at run time (no request of it in flight): its slot is freed at the
        next schedule()."""
        with self._lock:
            self._lora_unloaded.append(name)

    def num_sequences_of_lora(self, name: str) -> int:
        """Unfinished sequences (running, waiting, just added) of adapter `name` (engine thread)."""
        running, waiting = self._lora_counts()
        return running[name] + waiting[name]

    def _max_len(self, prompt_len: int, max_tokens: int | None) -> int:
        """Total length at which a sequence stops; raises ValueError when it can never run."""
        cfg = self.config
        if max_tokens is None:
            if prompt_len >= self._context_limit:
                raise ValueError(f"prompt ({prompt_len} tokens) leaves no room for output: the context "
                                 f"limit is {self._context_limit} tokens")
            return self._context_limit
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        total = prompt_len + max_tokens
        if total > cfg.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                             f"max_model_len ({cfg.max_model_len})")
        pages = self.allocator.pages_to_hold(total, cfg.max_num_batched_tokens)
        if pages > self.allocator.num_pages:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {pages} KV "
                             f"pages; the pool has {self.allocator.num_pages}")
        return total

    def _remove(self, request_id: str, sample_index: int | None, is_abort: bool, plan: StepPlan) -> None:
        seqs = self._requests.get(request_id)
        if seqs is None:
            return
        targets = [s for s in seqs if s.status is not SequenceStatus.FINISHED
                   and (sample_index is None or s.sample_index == sample_index)]
        for seq in targets:
            for other in seqs:  # a sibling not yet forked leaves its leader's list
                if seq in other.pending_siblings:
                    other.pending_siblings.remove(seq)
            survivors = [p for p in seq.pending_siblings if p not in targets]
            if survivors:
                self._hand_over(seq, survivors)
            seq.pending_siblings = []
            if is_abort:
                plan.finished.append(TokenEvent(request_id, seq.sample_index, None, None, None,
                                                FinishReason.ABORT, seq.num_prompt_tokens,
                                                seq.num_cached_prompt_tokens))
            self._retire(seq)

    def _hand_over(self, leader: Sequence, survivors: list[Sequence]) -> None:
        """A leader removed before its fork passes the role (and its pages, by reference) to the
        first surviving sibling, which then prefills on for the rest."""
        heir = survivors[0]
        heir.pending_siblings = survivors[1:]
        heir.fork_pending = False
        if self.allocator.has_sequence(leader.seq_id):
            self._commit(leader)
            self.allocator.fork(leader.seq_id, heir.seq_id)
        heir.num_computed_tokens = leader.num_computed_tokens
        heir.num_cached_prompt_tokens = leader.num_cached_prompt_tokens
