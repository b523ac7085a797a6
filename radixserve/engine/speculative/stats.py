"""Speculation's cumulative counters (vLLM's spec_decode counting: a draft is one request's
proposal in one step; accepted tokens exclude the model's own next token)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationCounters:
    steps: int = 0  # engine steps that ran a decode row
    speculative_steps: int = 0  # of those, steps with at least one draft verified
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose token i + 1 was accepted.
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # time spent proposing

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified row yields on average: accepted drafts + the model's own."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0
