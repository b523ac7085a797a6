"""The speculative drafter's parts without a model: the n-gram index against a brute-force
search, the namespace table's isolation and bound, the greedy and sampled acceptance rules (the
sampled one against the distributions it must preserve, by frequencies), the cost model's
choice (a compute-bound step never drafts; the step's time beside the forward counts) and
auto's acceptance estimate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve import config, sampling_params
from radixserve.engine.speculative.cost_model import StepCostModel
from radixserve.engine.speculative.namespace_table import NamespaceTable
from radixserve.engine.speculative.ngram_index import NgramIndex
from radixserve.engine.speculative.policy import (
    PRIOR_ACCEPTANCE,
    Speculation,
    SpeculationSettings,
    acceptance_of,
)
from radixserve.engine.speculative.verify import accept_greedy, accept_sampled


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # latest earlier occurrence first
            if tokens[end - n : end] == suffix:
                return n, tokens[end : end + k]
    return 0, []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 6),
       st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_ngram_index_finds_the_latest_longest_earlier_match(tokens, k, growth):
    # Grown step by step as a request's output grows: the incremental index answers as a
    # search of the whole sequence would.
    index = NgramIndex(2, 4)
    cut = 0
    for step in growth:
        cut = min(len(tokens), cut + step)
        assert index.continuation(tokens[:cut], k) == _brute(tokens[:cut], 2, 4, k)


def test_namespace_table_answers_only_its_own_namespace():
    table = NamespaceTable(2, 4, span=8, capacity=1000)
    table.ingest("tenant-a", [1, 2, 3, 4, 5, 6, 7], start=0)
    assert table.continuation("tenant-a", [9, 2, 3], 3) == (2, [4, 5, 6])
    assert table.continuation("tenant-b", [9, 2, 3], 3) == (0, [])


def test_namespace_table_holds_at_most_its_capacity_and_forgets_the_oldest():
    table = NamespaceTable(2, 2, span=4, capacity=10)
    table.ingest(None, list(range(100)), start=0)
    assert len(table) == 10
    assert table.continuation(None, [3, 4], 2) == (0, [])  # long gone
    assert table.continuation(None, [97, 98], 2) == (2, [99])


@pytest.mark.parametrize(("draft", "targets", "taken"), [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted, plus the model's next
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the first mismatch ends it, the model's token taken
    ([5, 6, 7], [1, 6, 7, 8], [1]),  # nothing accepted: plain decoding's one token
])
def test_greedy_acceptance_keeps_the_matching_prefix_and_the_models_token(draft, targets, taken):
    assert accept_greedy(draft, targets) == taken


def test_cost_model_drafts_in_a_memory_bound_step_and_never_in_a_compute_bound_one():
    # Flat to 8 rows (weights read once), then a row's share each: as a CPU measures it.
    model = StepCostModel((1, 2, 4, 8, 16, 32, 64), (10.0, 10.1, 10.2, 10.4, 20.0, 40.0, 80.0))
    assert model.best_draft_length(rows=1, acceptance=0.7, available=4) == 4
    assert model.best_draft_length(rows=1, acceptance=0.0, available=4) == 0
    assert model.best_draft_length(rows=32, acceptance=0.9, available=4) == 0


def test_the_step_overhead_makes_drafting_pay_in_a_step_the_forward_alone_would_not():
    # As measured on the default model: a decode step's forward grows by ~0.9 ms a row at 4
    # rows, and the step spends ~6 ms beside it (scheduling, sampling, detokenizing).
    model = StepCostModel((1, 2, 4, 8, 16), (5.4, 5.7, 7.9, 11.4, 19.8))
    assert model.best_draft_length(rows=4, acceptance=0.4, available=8) == 0
    assert model.best_draft_length(rows=4, acceptance=0.4, available=8, overhead=6.0) > 0
    # In a compute-bound step a token verified costs a row's whole share: only a draft that
    # is likely to hold saves more of the overhead than that.
    steep = StepCostModel((1, 2, 4, 8), (1.0, 2.0, 4.0, 8.0))
    assert steep.best_draft_length(rows=4, acceptance=0.3, available=8, overhead=6.0) == 0
    assert steep.best_draft_length(rows=4, acceptance=0.9, available=8, overhead=6.0) > 0


def test_acceptance_counts_the_tokens_after_a_rejection_as_untried():
    request = SimpleNamespace(spec_drafted=0, spec_accepted=0, spec_rejections=0)
    speculation = Speculation(SpeculationSettings("auto", 8, 4096))
    assert acceptance_of(request) == PRIOR_ACCEPTANCE
    for _ in range(10):
        speculation.verified(request, drafted=8, accepted=6)  # the 7th token missed
    # 60 accepted of 70 tried (the 8th never was), with the prior's 2 of 4.
    assert acceptance_of(request) == pytest.approx(62 / 74)
    assert request.spec_drafted == 80 and request.spec_rejections == 10
    for _ in range(10):
        speculation.verified(request, drafted=8, accepted=8)
    assert acceptance_of(request) == pytest.approx(142 / 154)


def test_the_overhead_estimate_follows_the_steps_the_engine_observes():
    speculation = Speculation(SpeculationSettings("auto", 8, 4096),
                              StepCostModel((1, 2, 4), (0.005, 0.006, 0.008)))
    for _ in range(100):
        speculation.observe_step(0.014, 4)  # 8 ms of forward, 6 ms beside it
    assert speculation.overhead == pytest.approx(0.006, rel=1e-3)
    for _ in range(100):
        speculation.observe_step(0.004, 4)  # faster than the probe: nothing beside it
    assert speculation.overhead == pytest.approx(0.0, abs=1e-6)


def test_the_speculative_settings_are_the_same_for_requests_and_the_engine():
    assert config.SPECULATIVE_METHODS == sampling_params.SPECULATIVE_METHODS
    assert config.MAX_SPECULATIVE_TOKENS == sampling_params.MAX_SPECULATIVE_TOKENS
    with pytest.raises(sampling_params.SamplingParamError, match="speculative"):
        sampling_params.SamplingParams(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        config.EngineConfig(num_speculative_tokens=0)


def test_sampled_acceptance_gives_each_token_the_models_distribution():
    # Row j's distribution holds after the draft's first j tokens were output: the first token
    # must follow p0, the second p1 when the first was the draft's, the third p2 likewise.
    probs = torch.tensor([[0.1, 0.2, 0.4, 0.2, 0.1],
                          [0.3, 0.05, 0.05, 0.5, 0.1],
                          [0.0, 0.6, 0.1, 0.1, 0.2]], dtype=torch.float64)
    draft = [2, 3]
    generator = torch.Generator().manual_seed(7)
    trials = 20_000
    outcomes = [accept_sampled(draft, probs, generator) for _ in range(trials)]
    checks = [(0, [o[0] for o in outcomes]),
              (1, [o[1] for o in outcomes if o[0] == 2]),
              (2, [o[2] for o in outcomes if o[:2] == [2, 3]])]
    for row, tokens in checks:
        counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
        expected = probs[row] * len(tokens)
        sigma = (expected * (1 - probs[row])).sqrt().clamp(min=1.0)
        assert ((counts - expected).abs() <= 4.5 * sigma).all(), (row, counts, expected)
