"""Host-side request types: what the engine accepts, what it streams back, and the per-sample state
the scheduler keeps. Pure Python (no jax): these objects live on the engine thread.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations; keeps this module importable on its own
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.speculative.ngram import TokenHistory
    from jaxserve.structured.guide import CompiledGrammar, Guide


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: "SamplingParams"
    eos_token_ids: frozenset[int] = frozenset()  # ignored when params.ignore_eos
    priority: int = 0                            # lower runs first under priority scheduling
    cache_salt: str | None = None                # per-tenant prefix-cache namespace
    # params.structured_outputs compiled by the front end (server, LLM) before submitting
    grammar: "CompiledGrammar | None" = None
    lora_name: str | None = None                 # multi-LoRA: the adapter (None: the base model)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclasses.dataclass(slots=True)
class TokenEvent:
    """One sampled token of one sample (or a bare finish: token_id None, e.g. an abort)."""

    request_id: str
    sample_index: int
    token_id: int | None
    logprob: float | None
    # the most likely ids and their logprobs, as the sampler's two parallel lists (no pair per
    # alternative is built on the engine thread: top_logprobs pairs them for the reader)
    top: tuple[list[int], list[float]] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int

    @property
    def top_logprobs(self) -> list[tuple[int, float]] | None:
        """[(id, logprob)] of the most likely ids, most likely first; None without logprobs."""
        return None if self.top is None else list(zip(*self.top))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request: its tokens and how many of them have K/V in the cache.

    After a preemption the sequence is recomputed: `num_computed_tokens` drops to 0 and the prompt
    plus the tokens generated so far are prefilled again; nothing already emitted is emitted twice.
    `num_tokens` counts the tokens known on the host; `num_inflight` more are sampled but not yet
    appended (async scheduling), so `num_computed_tokens` may reach `num_tokens + num_inflight`.
    """

    seq_id: str
    request: Request
    sample_index: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0       # tokens whose K/V is (or, during a step, will be) in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    # n > 1: the leader (sample 0) prefills the prompt once, then hands its pages to these siblings.
    pending_siblings: list["Sequence"] = dataclasses.field(default_factory=list)
    fork_pending: bool = False         # a sibling still waiting for the leader's fork (holds no pages)
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission (reported in events)
    admitted_once: bool = False        # later admissions are recomputes after a preemption
    max_len: int = 0                   # total tokens (prompt + output) at which the sequence stops (LENGTH)
    # Async scheduling: tokens sampled by planned steps whose ids update() has not appended yet
    # (they are still on the device). The next decode can run on them through a placeholder.
    num_inflight: int = 0
    guide: "Guide | None" = None       # its grammar state (structured output), advanced per token
    # Speculative decoding: consecutive fruitless proposals (none found, or every draft rejected), and
    # the scheduler step from which it proposes again (it backs off after repeated misses).
    draft_misses: int = 0
    draft_resume_step: int = 0
    token_history: "TokenHistory | None" = None  # n-gram proposals: its tokens as bytes, grown per step
    lora_slot: int = -1                # multi-LoRA: the device slot it pins while admitted (-1: none)
    # admission: (num_tokens, prefix-cache page keys of its tokens) while it waits at the head of the line
    prefix_keys: tuple[int, list[bytes]] | None = None
    # The scheduler's per-step shortcuts (engine/scheduler.py, engine/updates.py): positions below
    # decode_until lie in a page held and private to the sequence (a decode there needs no growth;
    # reset when its pages are shared or freed); no page of it fills before min(computed, known
    # tokens) reaches commit_at; a token outside stop_ids (the stop ids, and the EOS ids unless
    # ignored) cannot stop it before max_len.
    decode_until: int = 0
    commit_at: int = 0
    # a hybrid stack with prefix caching: the prefix keys of its full pages known at admission, under
    # which its prefill chunks snapshot their end states (engine/state_slots.py)
    snapshot_keys: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    snapshot_cut: int = 0  # where its prefix-cache match ended past the last snapshot: a chunk ends there
    stop_ids: frozenset[int] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.request.params
        eos = frozenset() if params.ignore_eos else frozenset(self.request.eos_token_ids)
        self.stop_ids = eos | frozenset(params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens [start, stop) of prompt + output, without building the whole list."""
        prompt = self.request.prompt_token_ids
        p = len(prompt)
        if stop <= p:
            return prompt[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return prompt[start:] + self.output_token_ids[:stop - p]

    def stop_reason(self, token: int) -> FinishReason | None:
        """Why the sequence stops with `token` just appended (None: it goes on)."""
        params = self.request.params
        if len(self.output_token_ids) > params.min_tokens:  # stops count only after min_tokens tokens
            if not params.ignore_eos and token in self.request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if self.guide is not None and self.guide.finished:  # the grammar is complete: nothing else may follow
            return FinishReason.STOP
        if self.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None

    @property
    def target_len(self) -> int:
        """How far this sequence must be computed before it can run its next chunk.

        A leader with siblings still waiting stops one short of the prompt: the last prompt token
        is computed by each sample on its own, so each gets its own logits row (and seed).
        """
        if self.pending_siblings:
            return self.num_prompt_tokens - 1
        return self.num_tokens + self.num_inflight
