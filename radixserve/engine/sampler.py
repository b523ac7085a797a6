"""Turns a batch of next-token logits into tokens: greedy, temperature, top-k, top-p, seeds.

Greedy rows take an argmax in one call; sampled rows are handled one by one, since each may
carry its own generator (a per-request seed must not depend on what else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, top-k {token: logprob}) when asked for, else None.
    logprobs: list[tuple[float, dict[int, float]] | None]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[set[int] | None] | None = None,
) -> SampleResult:
    """Samples one token per row of `logits` ([R, vocab], float32).

    `banned[i]` lists tokens row i may not produce yet (EOS before min_tokens).
    """
    logits = logits.float()
    if banned is not None and any(banned):
        logits = logits.clone()  # the caller's logits stay untouched
    if banned is not None:
        for i, tokens in enumerate(banned):
            if tokens:
                logits[i, list(tokens)] = float("-inf")
    chosen = torch.argmax(logits, dim=-1)
    tokens: list[int] = chosen.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        for row, i in enumerate(want):
            k = params[i].logprobs or 0
            top = torch.topk(lp[row], k) if k else None
            top_map = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
            logprobs[i] = (float(lp[row, tokens[i]]), top_map)
    return SampleResult(tokens, logprobs)
