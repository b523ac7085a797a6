"""logit_bias, presence/frequency penalties and repetition_penalty against a plain reference
written here (a loop over a small vocabulary per formula), for batches whose rows ask for
different things; and the promises around them: the input is never changed, rows that ask
nothing are untouched, the order is repetition -> frequency/presence -> bias, and the sampler
returns log-probabilities of the adjusted distribution.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.engine.logits_processors import apply_logits_processors
from radixserve.engine.sampler import sample
from radixserve.engine.sampling_rows import SampleRow
from radixserve.sampling_params import SamplingParams

VOCAB = 12


def reference(logits: list[float], params: SamplingParams, token_ids: list[int],
              prompt_len: int) -> list[float]:
    """One row, formula by formula, in the documented order."""
    out = list(logits)
    seen = set(token_ids)
    for t in range(VOCAB):
        if t in seen:
            p = params.repetition_penalty
            out[t] = out[t] / p if out[t] > 0 else out[t] * p
    counts = Counter(token_ids[prompt_len:])
    for t in range(VOCAB):
        out[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    for t in range(VOCAB):
        out[t] += (params.logit_bias or {}).get(t, 0.0)
    return out


def row(params: SamplingParams, token_ids: list[int] | None = None, prompt_len: int = 0) -> SampleRow:
    return SampleRow(params, None, token_ids=token_ids, prompt_len=prompt_len)


penalty = st.floats(-2, 2, allow_nan=False, width=32)
params_strategy = st.builds(
    SamplingParams,
    presence_penalty=st.one_of(st.just(0.0), penalty),
    frequency_penalty=st.one_of(st.just(0.0), penalty),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.125, 2, width=32)),
    logit_bias=st.one_of(st.none(), st.dictionaries(
        st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=4)),
)
row_strategy = st.tuples(
    params_strategy,
    st.lists(st.integers(0, VOCAB - 1), max_size=10),  # prompt
    st.lists(st.integers(0, VOCAB - 1), max_size=10),  # output
)


@settings(max_examples=150, deadline=None)
@given(st.lists(row_strategy, min_size=1, max_size=5), st.integers(0, 2**31))
def test_matches_reference_row_by_row(specs: list[tuple[SamplingParams, list[int], list[int]]],
                                      seed: int) -> None:
    logits = torch.randn(len(specs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    before = logits.clone()
    rows = [row(params, prompt + output, len(prompt)) for params, prompt, output in specs]
    adjusted = apply_logits_processors(logits, rows)
    assert torch.equal(logits, before)  # never in place
    for i, (params, prompt, output) in enumerate(specs):
        expected = reference(before[i].tolist(), params, prompt + output, len(prompt))
        torch.testing.assert_close(adjusted[i], torch.tensor(expected), rtol=1e-5, atol=1e-4)
        asks = params.logit_bias or params.repetition_penalty != 1 or (
            params.presence_penalty != 0 or params.frequency_penalty != 0)
        if not asks:
            assert torch.equal(adjusted[i], before[i])  # bit for bit


def test_a_batch_asking_nothing_gets_its_own_tensor_back() -> None:
    logits = torch.randn(3, VOCAB)
    rows = [row(SamplingParams(), [1, 2, 3], 2), row(SamplingParams(temperature=0)),
            row(SamplingParams(logit_bias={}))]
    assert apply_logits_processors(logits, rows) is logits


def test_mixed_batch_changes_only_the_rows_that_ask() -> None:
    logits = torch.zeros(3, VOCAB) + 1.0
    rows = [row(SamplingParams(), [5, 5], 1),
            row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [5, 5, 5, 7], 1),
            row(SamplingParams(logit_bias={3: -100}), [5], 1)]
    adjusted = apply_logits_processors(logits, rows)
    assert adjusted is not logits and torch.equal(logits, torch.ones(3, VOCAB))
    assert torch.equal(adjusted[0], logits[0])
    # Row 1: the prompt's 5 is not counted (output only): 5 twice, 7 once.
    assert adjusted[1, 5].item() == 1.0 - (0.5 * 2 + 0.25)
    assert adjusted[1, 7].item() == 1.0 - (0.5 + 0.25)
    assert adjusted[1, 0].item() == 1.0
    assert adjusted[2, 3].item() == -99.0 and adjusted[2, 5].item() == 1.0


def test_repetition_penalty_covers_the_prompt_and_pushes_both_signs_down() -> None:
    logits = torch.tensor([[4.0, -4.0, 4.0, -4.0] + [0.0] * (VOCAB - 4)])
    adjusted = apply_logits_processors(logits, [row(SamplingParams(repetition_penalty=2.0),
                                                    [0, 1, 1], prompt_len=3)])
    # Tokens 0 and 1 appear in the prompt only, and are penalised; 2 and 3 never appeared.
    assert adjusted[0, :4].tolist() == [2.0, -8.0, 4.0, -4.0]


def test_order_is_repetition_then_frequency_presence_then_bias() -> None:
    settings_ = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={0: 3.0,
                                                                                         1: 3.0})
    logits = torch.tensor([[4.0, -2.0] + [0.0] * (VOCAB - 2)])
    adjusted = apply_logits_processors(logits, [row(settings_, [9, 0, 1], prompt_len=1)])
    # 4 / 2 - 1 + 3 = 4 (bias first would give (4 + 3) / 2 - 1 = 2.5);
    # -2 * 2 - 1 + 3 = -2 (bias first: (-2 + 3) / 2 - 1 = -0.5).
    assert adjusted[0, :2].tolist() == [4.0, -2.0]


def test_penalties_wait_for_output_and_handle_rows_without_history() -> None:
    logits = torch.randn(2, VOCAB)
    rows = [row(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), [1, 2, 3], 3),
            row(SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5), None)]
    assert torch.equal(apply_logits_processors(logits, rows), logits)


def test_sampler_draws_and_reports_logprobs_of_the_adjusted_logits() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 5.0
    rows = [row(SamplingParams(temperature=0, logprobs=1, logit_bias={7: 100})),
            row(SamplingParams(temperature=1.0, seed=1, logprobs=0, logit_bias={4: 100}))]
    rows[1].generator = torch.Generator().manual_seed(1)
    result = sample(logits, rows)
    assert result.token_ids == [7, 4]
    chosen, top = result.logprobs[0]  # type: ignore[misc]
    expected = torch.log_softmax(torch.tensor([5.0] + [0.0] * 6 + [100.0] + [0.0] * 4), -1)
    assert math.isclose(chosen, expected[7].item(), abs_tol=1e-6) and list(top) == [7]
    assert logits[0, 7].item() == 0.0  # the caller's logits stay as they were
