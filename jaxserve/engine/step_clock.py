"""The decode step clock: per sequence bucket, how many decode-only steps ran, how long they took
(completion minus the later of dispatch and the previous completion), with how many rows and how
many context tokens, read by /metrics as jaxserve:decode_step_seconds and its counters."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepTimings:
    """Seconds spent in the steps' phases: host scheduling, input building, grammar masks, device (dispatching the
    step plus waiting for its sampled ids; with async scheduling the wait is only the part not
    hidden behind planning the next step), and applying the ids."""

    schedule: float = 0.0
    build: float = 0.0
    mask: float = 0.0       # grammar bitmasks of constrained rows (structured output)
    device: float = 0.0
    update: float = 0.0
    steps: int = 0
    # Steps that only decode (one token per sequence, no drafts), by their sequence bucket S:
    # S -> DecodeSteps. A step's seconds run from its dispatch, or from the previous step's
    # completion when it was dispatched before that (async scheduling), to its own completion: the
    # interval a busy engine spends per step, which is the decode step time users see.
    decode: dict[int, "DecodeSteps"] = dataclasses.field(default_factory=dict)

    def record_decode(self, bucket: int, seconds: float, rows: int, context: int) -> None:
        entry = self.decode.setdefault(bucket, DecodeSteps())
        entry.steps += 1
        entry.seconds += seconds
        entry.rows += rows
        entry.context_tokens += context


@dataclasses.dataclass
class DecodeSteps:
    """Sums over the decode-only steps of one sequence bucket: the mean step time is seconds / steps,
    at rows / steps sequences holding context_tokens / steps tokens of KV in all."""

    steps: int = 0
    seconds: float = 0.0
    rows: int = 0
    context_tokens: int = 0
