"""Exact verification of a draft against the target model's own distribution.

A speculating row holds the request's newest token followed by its draft d_1..d_k; row j's
distribution p_j is the request's own (its logits processors, temperature, top-k/top-p) with
d_1..d_j taken as output. Greedy: plain decoding would produce t_0 = argmax p_0, then t_1 if
d_1 == t_0, and so on, so the matching prefix plus the model's next token is exactly its output.
Sampled: accept d_{j+1} with probability p_j(d_{j+1}); at the first rejection draw from p_j
with d_{j+1} removed, renormalised (the rule for a deterministic draft, Leviathan et al. 2023;
Chen et al. 2023); if all are accepted draw the next token from p_k. Each token then has
exactly the distribution plain sampling gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy request takes from one verified row: `targets` has one token per
    row (len(draft) + 1); returns targets[:a + 1], a the matching prefix's length."""
    assert len(targets) == len(draft) + 1, (len(draft), len(targets))
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return list(targets[: accepted + 1])


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised float64 probabilities, by inverse transform."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, dtype=torch.float64, generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1))


def accept_sampled(draft: Sequence[int], probs: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled request takes from one verified row: `probs` [len(draft) + 1,
    vocab] float64 holds each row's sampling distribution; `generator` the request's."""
    assert probs.shape[0] == len(draft) + 1, (len(draft), probs.shape)
    for j, token in enumerate(draft):
        p = probs[j]
        if torch.rand(1, dtype=torch.float64, generator=generator).item() < p[token].item():
            continue
        residual = p.clone()
        residual[token] = 0.0
        return [*draft[:j], _draw(residual, generator)]
    return [*draft, _draw(probs[-1], generator)]
