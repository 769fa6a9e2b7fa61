"""Which decodes carry drafts and how many (host, no jax): the scheduler's side of speculative decoding.

A decode may draft when its last token is known (nothing in flight), it is not a leader still
holding its samples' fork, and it is not backing off. At most k drafts, the step's leftover budget
minus its own token, and what max_len leaves after the bonus token. n-gram drafts are looked up
here and cut where the sequence's grammar refuses one; a draft model's or EAGLE-3 head's are
DRAFT_SLOTs that the engine fills (Scheduler.set_drafts) after running the draft on the device.

Back-off: a sequence whose proposals miss MISSES_BEFORE_BACKOFF times in a row (none found, or every
draft rejected) stops proposing for 1, 2, 4 .. MAX_BACKOFF_STEPS steps; a hit resets it. While no
running sequence may propose, `active()` is False and the engine runs steps asynchronously again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from jaxserve.speculative import ngram
from jaxserve.speculative.accept import num_accepted
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.stats import SpecDecodeStats

if TYPE_CHECKING:
    from jaxserve.core.request import Sequence
    from jaxserve.core.step_plan import StepPlan

DRAFT_SLOT = -2  # in ScheduledChunk.draft_token_ids: a draft the draft model proposes before the step
MISSES_BEFORE_BACKOFF = 2
MAX_BACKOFF_STEPS = 16


class Drafting:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.num_steps = 0  # scheduler steps planned (back-off is counted in them)

    def start_step(self) -> None:
        self.num_steps += 1

    def active(self, running: Iterable["Sequence"], num_enqueued: int) -> bool:
        """Whether the next step may carry drafts: the enqueued sequences (running and waiting, as
        vLLM counts them) within disable_by_batch_size, and some running sequence not backing off.
        Counting the waiting ones keeps a burst's admission steps free of drafts."""
        return self.spec.active(num_enqueued) and any(s.draft_resume_step <= self.num_steps + 1 for s in running)

    def drafts(self, seq: "Sequence", budget: int) -> list[int]:
        """Drafts for this step's decode of seq (`budget`: tokens the step has left, its own included)."""
        if seq.num_inflight or seq.pending_siblings or seq.num_computed_tokens != seq.num_tokens - 1:
            return []  # the last token must be known (async: the previous step finished)
        if self.num_steps < seq.draft_resume_step:
            return []  # backing off after fruitless proposals
        spec = self.spec
        k = min(spec.num_speculative_tokens, budget - 1, seq.max_len - seq.num_tokens - 1)
        if k <= 0:
            return []
        if spec.model_proposer:
            return [DRAFT_SLOT] * k
        history = seq.token_history
        if history is None:
            history = seq.token_history = ngram.TokenHistory()
        history.extend(seq.token_slice(history.length, seq.num_tokens))  # the tokens since its last proposal
        drafts = history.propose(k, spec.prompt_lookup_min, spec.prompt_lookup_max).tolist()
        drafts = self.grammar_cut(seq, drafts)
        if not drafts:
            self.outcome(seq, hit=False)
        return drafts

    @staticmethod
    def fill_slots(plan: "StepPlan", proposals: list[list[int]]) -> None:
        """Fills the DRAFT_SLOTs of the plan's chunks (in plan order) with the draft model's
        proposals, cut where a grammar refuses one; slots left over stop being computed."""
        chunks = [c for c in plan.listed if c.draft_token_ids]  # steady decodes have none
        if len(chunks) != len(proposals):
            raise ValueError(f"{len(proposals)} proposals for {len(chunks)} chunks with draft slots")
        for chunk, drafts in zip(chunks, proposals):
            seq = plan.owners[chunk.seq_id]
            slots = len(chunk.draft_token_ids)
            drafts = Drafting.grammar_cut(seq, list(drafts[:slots]))
            chunk.token_ids = chunk.token_ids[:len(chunk.token_ids) - slots] + drafts
            chunk.draft_token_ids = drafts
            seq.num_computed_tokens -= slots - len(drafts)
            plan.num_tokens -= slots - len(drafts)
            plan.num_drafts -= slots - len(drafts)
            plan.num_samples -= slots - len(drafts)

    @staticmethod
    def grammar_cut(seq: "Sequence", drafts: list[int]) -> list[int]:
        """The leading drafts a constrained sequence's grammar accepts in turn."""
        if drafts and seq.guide is not None:
            return drafts[:seq.guide.valid_prefix(drafts)]
        return drafts

    def verified(self, seq: "Sequence", drafts: list[int], sampled: list[int]) -> int:
        """Accepted drafts given the sampled rows (speculative/accept.py); counts them and the back-off."""
        accepted = num_accepted(drafts, sampled)
        self.stats.record(len(drafts), accepted)
        self.outcome(seq, hit=accepted > 0)
        return accepted

    def outcome(self, seq: "Sequence", hit: bool) -> None:
        """A hit (a draft accepted) resets the back-off; each miss from the MISSES_BEFORE_BACKOFF-th on
        doubles the steps without proposals (up to MAX_BACKOFF_STEPS)."""
        if hit:
            seq.draft_misses = 0
            return
        seq.draft_misses += 1
        if seq.draft_misses >= MISSES_BEFORE_BACKOFF:
            pause = min(1 << (seq.draft_misses - MISSES_BEFORE_BACKOFF), MAX_BACKOFF_STEPS)
            seq.draft_resume_step = self.num_steps + 1 + pause
