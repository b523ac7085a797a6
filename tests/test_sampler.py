"""The sampler draws from the distribution it is given: frequencies against softmax(logits /
temperature) after top-k/top-p, tokens of probability 0 never drawn, seeds reproducible and
independent of the rows beside them, greedy rows untouched by sampled ones."""

from __future__ import annotations

import torch

from radixserve.engine.sampler import sample
from radixserve.engine.sampling_rows import SampleRow
from radixserve.sampling_params import SamplingParams

LOGITS = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5, -3.0])
DRAWS = 20000


def _frequencies(params: SamplingParams, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(LOGITS))
    rows = [SampleRow(params, generator)] * 50
    for _ in range(DRAWS // 50):  # 50 rows a call: the batched path, not one row at a time
        for token in sample(LOGITS.expand(50, -1).contiguous(), rows).token_ids:
            counts[token] += 1
    return counts / DRAWS


def test_frequencies_follow_the_tempered_distribution() -> None:
    for temperature in (1.0, 0.5, 1.7):
        expected = torch.softmax(LOGITS / temperature, dim=-1)
        got = _frequencies(SamplingParams(temperature=temperature))
        assert got[3] == 0  # probability 0 (a -inf logit): never drawn
        # 20,000 draws: a frequency's standard error is at most 0.0036.
        assert torch.allclose(got, expected, atol=0.015), (temperature, got, expected)


def test_top_k_and_top_p_cut_the_tail() -> None:
    got = _frequencies(SamplingParams(temperature=1.0, top_k=2))
    kept = torch.softmax(torch.tensor([1.0, 2.0]), dim=-1)
    assert got[[0, 3, 4, 5]].sum() == 0 and torch.allclose(got[[1, 2]], kept, atol=0.015)
    probs = torch.softmax(LOGITS, dim=-1)  # 0.58 (token 2), 0.21 (1), 0.13 (4), ...
    got = _frequencies(SamplingParams(temperature=1.0, top_p=0.75))
    assert got[[0, 3, 5]].sum() == 0  # the smallest set reaching 0.75 is {2, 1}
    assert torch.allclose(got[[2, 1]], probs[[2, 1]] / probs[[2, 1]].sum(), atol=0.015)


def test_seeds_reproduce_whatever_the_batch() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 2

    def seeded(seed: int) -> SampleRow:
        return SampleRow(SamplingParams(temperature=1.0, seed=seed),
                         torch.Generator().manual_seed(seed))

    alone = [sample(logits[i : i + 1], [seeded(10 + i)]).token_ids[0] for i in range(4)]
    greedy = SampleRow(SamplingParams(temperature=0), None)
    together = sample(logits, [seeded(10), greedy, seeded(12), seeded(13)]).token_ids
    assert together[0] == alone[0] and together[2:] == alone[2:]
    assert together[1] == int(torch.argmax(logits[1]))
    again = sample(logits, [seeded(10), seeded(11), seeded(12), seeded(13)]).token_ids
    assert again == alone
