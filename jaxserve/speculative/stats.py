"""Speculative decoding counters (host): what was drafted and what verification accepted, in the
shape of vLLM's spec_decode metrics (totals plus acceptance per draft position)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0            # verified proposals (one per speculating sequence and step)
    num_draft_tokens: int = 0      # proposed tokens
    num_accepted_tokens: int = 0   # of those, accepted
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [k]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> "SpecDecodeStats":
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified proposal: 1 (the correction or bonus) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts accumulated after `earlier` (a copy taken before)."""
        return SpecDecodeStats(
            self.num_speculative_tokens, self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens, self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)])

    def summary(self) -> str:
        """One log line, like vLLM's periodic SpecDecoding metrics line."""
        per_pos = ", ".join(f"{a / self.num_drafts:.3f}" if self.num_drafts else "0.000"
                            for a in self.accepted_per_position)
        return (f"speculative decoding: mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"accepted {self.num_accepted_tokens}/{self.num_draft_tokens} draft tokens "
                f"({100 * self.acceptance_rate:.1f}%), {self.num_drafts} drafts, per-position acceptance [{per_pos}]")
