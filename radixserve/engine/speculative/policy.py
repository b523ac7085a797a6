"""Which requests speculate, with how many tokens, from which drafter: the engine's setting or
the request's own (SamplingParams.speculative / num_speculative_tokens), within what the request
can still produce, and under `auto` the start-up cost model and the request's acceptance so far.

Sampled requests speculate too, verified by the exact rule (verify.py); a seeded one is
reproducible under the same drafts (ngram: its own tokens), not token for token equal to its
plain decoding (the draws differ, the distribution does not).

Constrained requests (structured output, forced tool calls) speculate under their grammar: a
draft is cut to the tokens the grammar allows, and each verified position samples under the
grammar's mask after the draft tokens before it (the matcher is rolled back after computing
them), so what is accepted is what plain constrained decoding would produce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from radixserve.engine.speculative.cost_model import StepCostModel
from radixserve.engine.speculative.drafter import (
    Drafter,
    DraftSource,
    NgramDrafter,
    SuffixDrafter,
)
from radixserve.engine.speculative.namespace_table import NamespaceTable
from radixserve.engine.speculative.stats import SpeculationCounters
from radixserve.sampling_params import SamplingParams

# The table of earlier requests' continuations (all namespaces together): ~13 MB at most.
TABLE_ENTRIES = 65_536
# Acceptance assumed for a request's first drafts under `auto`, as if from this many tokens.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4
# Weight of one decode step in the running estimate of a step's time beside the forward.
OVERHEAD_SMOOTHING = 0.1


class DraftCheck(Protocol):
    def valid_prefix(self, tokens: list[int]) -> int: ...


class SpeculatingRequest(DraftSource, Protocol):
    params: SamplingParams
    output_token_ids: list[int]
    matcher: DraftCheck | None
    spec_drafted: int
    spec_accepted: int
    spec_rejections: int


@dataclass(frozen=True)
class SpeculationSettings:
    method: str  # off | ngram | suffix | auto
    num_tokens: int  # the most tokens a step drafts for one request
    max_model_len: int


class Speculation:
    def __init__(self, settings: SpeculationSettings, cost: StepCostModel | None = None) -> None:
        self.settings = settings
        self.cost = cost  # measured by the engine when auto may be asked for
        self.ngram = NgramDrafter()
        self.suffix = SuffixDrafter(NamespaceTable(2, 4, span=16, capacity=TABLE_ENTRIES))
        self.counters = SpeculationCounters()
        # Seconds a decode step spends beside the forward the cost model timed (scheduling,
        # sampling, detokenizing), a running estimate: on a small model it is as long as the
        # forward, and a drafted token saves its share of it.
        self.overhead = 0.0

    def method_of(self, params: SamplingParams) -> str:
        return params.speculative or self.settings.method

    def draft(self, request: SpeculatingRequest, budget: int, rows: int) -> list[int]:
        """The tokens to verify after the request's newest one this step ([] for a plain
        decode row); `budget` caps their number, `rows` is the step's decode rows so far."""
        params = request.params
        method = self.method_of(params)
        if method == "off":
            return []
        k = min(params.num_speculative_tokens or self.settings.num_tokens, budget,
                # past max_tokens or the context nothing verified could be kept
                params.max_tokens - len(request.output_token_ids) - 1,
                self.settings.max_model_len - len(request.token_ids) - 1)
        if k <= 0:
            return []
        started = time.perf_counter()
        drafter: Drafter = self.ngram if method == "ngram" else self.suffix
        draft = drafter.propose(request, k)
        if draft and request.matcher is not None:
            draft = draft[: request.matcher.valid_prefix(draft)]
        if method == "auto" and draft and self.cost is not None:
            draft = draft[: self.cost.best_draft_length(max(rows, 1), acceptance_of(request),
                                                        len(draft), self.overhead)]
        self.counters.draft_seconds += time.perf_counter() - started
        return draft

    def verified(self, request: SpeculatingRequest, drafted: int, accepted: int) -> None:
        request.spec_drafted += drafted
        request.spec_accepted += accepted
        request.spec_rejections += accepted < drafted
        self.counters.record(drafted, accepted)

    def observe_step(self, seconds: float, rows: int) -> None:
        """A decode step's wall time at `rows` rows (no prefill in it): what the forward at
        those rows does not explain updates the overhead estimate."""
        if self.cost is None or rows <= 0:
            return
        beside = max(seconds - self.cost.step_seconds(rows), 0.0)
        self.overhead += OVERHEAD_SMOOTHING * (beside - self.overhead)

    def finished(self, request: SpeculatingRequest) -> None:
        """Feeds a finished request's verified tokens to its namespace's shared table, where
        its method reads that table (the table's upkeep is not paid with speculation off)."""
        prompt_len = len(request.prompt_token_ids)
        if self.method_of(request.params) in ("suffix", "auto") and \
                len(request.token_ids) > prompt_len:
            self.suffix.learn(request.namespace, request.token_ids, prompt_len)


def acceptance_of(request: SpeculatingRequest) -> float:
    """The request's per-token acceptance so far, with the prior: each verified draft token
    is a trial that ends at the first rejection, so tokens after it were never tried (counting
    accepted over drafted tokens would call a draft of 8 whose 7th missed 0.75, not 0.86)."""
    return ((request.spec_accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT)
            / (request.spec_accepted + request.spec_rejections + PRIOR_WEIGHT))
