"""What one step is: the scheduler's plan handed to the model runner (StepPlan: its steady decodes
as columns, DecodeRows, then ScheduledChunks), and what comes back (SampledRows: the sampled id of
each sample row). The runner side imports these, never the scheduler. Pure Python; no jax."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxserve.core.request import Request, Sequence, TokenEvent

PENDING_TOKEN = -1  # in ScheduledChunk.token_ids: the in-flight token sampled by the previous step


@dataclasses.dataclass(slots=True)
class SampledRows:
    """What the model runner returns for a plan: per sample row, in plan order (a chunk with d drafts
    has d + 1 rows), as Python lists, converted from the sampler's arrays once per step (no object
    per row). logprobs and the top lists are None when no row of the plan asked for logprobs."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None        # [rows][K] the K most likely ids, K = the most a row asked for
    top_logprobs: list[list[float]] | None = None

    @classmethod
    def from_output(cls, plan: "StepPlan", out: Any) -> "SampledRows":
        """From a fetched sampler output (numpy token_ids, logprobs, top_ids, top_logprobs)."""
        n, k = plan.num_samples, plan.num_top_logprobs
        if not plan.wants_logprobs:
            return cls(out.token_ids[:n].tolist())
        return cls(out.token_ids[:n].tolist(), out.logprobs[:n].tolist(), out.top_ids[:n, :k].tolist(),
                   out.top_logprobs[:n, :k].tolist())

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(slots=True)
class ScheduledChunk:
    seq_id: str
    request: Request
    sample_index: int
    token_ids: list[int]         # tokens whose K/V this step computes (a prefill chunk or 1 decode token);
                                 # PENDING_TOKEN: the token sampled for this sequence by the previous step
    start_pos: int               # absolute position of token_ids[0] (= tokens already in the KV cache)
    page_table: list[int]        # pages covering positions [0, start_pos + len(token_ids)): the allocator's
                                 # live list, not a copy (read it before the next schedule())
    sample: bool                 # chunk ends at the sequence's last token: one token is sampled
    output_token_ids: list[int]  # generated tokens so far; the live list, read it before update(); it lacks
                                 # the in-flight token (its count: start_pos + len(token_ids) - prompt length)
    lora_slot: int = -1          # multi-LoRA: the adapter's device slot (-1: the base model)
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # speculative: the last
                                 # len(draft_token_ids) entries of token_ids, each also a sample row
    # a stack of several KV layer groups (core/kv_groups.py): every group's table, page_table
    # first (live lists, like it); empty for one group
    group_page_tables: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def num_sample_rows(self) -> int:
        """Sampler rows: the last 1 + len(draft_token_ids) token rows of a sampling chunk, else 0."""
        return 1 + len(self.draft_token_ids) if self.sample else 0


@dataclasses.dataclass(slots=True)
class DecodeRows:
    """The plan's steady decodes as columns, each planned without a ScheduledChunk (per-step host
    work at a large batch is mostly these): one token row and one sample row per sequence; its
    token is an output token (PENDING_TOKEN while in flight), with no drafts, no grammar, and the
    page under it already held and private to it (no growth, no copy, no page-table change). They
    are the plan's first rows, in this order."""

    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)    # the token's position (its start_pos)
    token_ids: list[int] = dataclasses.field(default_factory=list)    # the token, or PENDING_TOKEN
    num_outputs: list[int] = dataclasses.field(default_factory=list)  # outputs before the row's sample,
                                                                      # an in-flight one included

    def __len__(self) -> int:
        return len(self.seqs)

    def remove(self, seq: Sequence) -> None:
        """Takes seq's row back (a preemption within the step that planned it)."""
        i = self.seqs.index(seq)
        for column in (self.seqs, self.positions, self.token_ids, self.num_outputs):
            del column[i]

    def chunk(self, i: int, page_tables: list[list[int]]) -> ScheduledChunk:
        """Row i as the ScheduledChunk the general path would have planned (page_tables: the
        allocator's live tables of the sequence)."""
        seq = self.seqs[i]
        return ScheduledChunk(seq.seq_id, seq.request, seq.sample_index, [self.token_ids[i]], self.positions[i],
                              page_tables[0], True, seq.output_token_ids, seq.lora_slot, [],
                              page_tables if len(page_tables) > 1 else [])


@dataclasses.dataclass
class StepPlan:
    decodes: DecodeRows = dataclasses.field(default_factory=DecodeRows)  # the first rows
    listed: list[ScheduledChunk] = dataclasses.field(default_factory=list)  # the other chunks, 1-token ones first
    num_tokens: int = 0
    num_samples: int = 0  # sampler rows: one per sampling chunk, plus one per draft token
    num_drafts: int = 0   # draft tokens of the plan's chunks
    num_top_logprobs: int = -1  # the most alternatives a sampling row's request asked for (-1: no logprobs)
    # (src_page, dst_page) copies done before the step; they read the pages as they were before the
    # step, and no page is a destination twice.
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # a hybrid stack's (src slot, dst slot) recurrent-state copies before the step (a fork: the
    # child's slot takes its parent's state; engine/state_slots.py)
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # host KV tier (page_allocator.py): done before the copies, demotions first
    demotions: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (device page, host slot)
    promotions: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host slot, device page)
    preempted: list[str] = dataclasses.field(default_factory=list)        # seq ids sent back to waiting
    finished: list[TokenEvent] = dataclasses.field(default_factory=list)  # finishes without a step (abort)
    # multi-LoRA: (slot, adapter name) to load into the device slots before the step runs
    lora_loads: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # sequences that left the batch (finished, aborted, preempted) since the previous plan with
    # chunks: the runner drops their persistent rows (runner/batch_rows.py) before this plan's
    released: list[Sequence] = dataclasses.field(default_factory=list, repr=False, compare=False)
    # seq_id -> the Sequence each listed chunk belongs to (update() must not look ids up again: a
    # finished request's id may be reused while its last step is still in flight)
    owners: dict[str, Sequence] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # seq_id -> its live page tables (the allocator's; one empty table once freed): what a
    # DecodeRows row reads when it is turned into a ScheduledChunk
    page_tables: Callable[[str], list[list[int]]] | None = dataclasses.field(default=None, repr=False,
                                                                               compare=False)
    # a hybrid stack's seq_id -> its recurrent-state slot (the allocator's live map), else None
    state_slots: dict[str, int] | None = dataclasses.field(default=None, repr=False, compare=False)
    # seq_id -> the snapshot slot its chunk's end state is also written to (engine/state_slots.py)
    state_snapshots: dict[str, int] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Every chunk in row order: the steady decodes made into ScheduledChunks, then the listed
        ones. Built on each call, for readers off the per-step path (the runner and update read the
        columns); read it before the next schedule(), like the live lists it holds."""
        d = self.decodes
        return [d.chunk(i, self.page_tables(s.seq_id)) for i, s in enumerate(d.seqs)] + self.listed

    @property
    def wants_logprobs(self) -> bool:
        """Some sampling row's request asked for logprobs."""
        return self.num_top_logprobs >= 0

    @property
    def num_seqs(self) -> int:
        """Sequences the plan runs (one chunk each)."""
        return len(self.decodes.seqs) + len(self.listed)

    @property
    def has_drafts(self) -> bool:
        return self.num_drafts > 0


@dataclasses.dataclass(frozen=True)
class SwapCosts:
    """What the scheduler weighs when it preempts with a host KV tier (the runner estimates them)."""

    recompute_seconds_per_token: float  # prefill of one token again
    move_seconds_per_page: float        # one page out to host memory and back


def check_sampled(plan: StepPlan, sampled: SampledRows) -> None:
    """Raises ValueError unless `sampled` has one row per sample row of `plan` (with logprobs when a
    row asked for them) and the plan is a scheduler's (an owner per chunk)."""
    if len(sampled) != plan.num_samples:
        raise ValueError(f"expected {plan.num_samples} sampled tokens for this plan, got {len(sampled)}")
    if len(plan.owners) != len(plan.listed):
        raise ValueError("the plan was not made by this scheduler's schedule()")
    if sampled.logprobs is None and plan.wants_logprobs:
        raise ValueError("a row of the plan asked for logprobs and the sampled rows have none")
