"""Turns a batch of next-token logits into tokens: the logits' adjustments (banned tokens, a
grammar's mask, logit_bias and penalties), then greedy, temperature, top-k, top-p, seeds.

Greedy rows take an argmax in one call; sampled rows draw one uniform number each from their
own generator (a per-request seed must not depend on what else is in the batch) and are
then batched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.engine.logits_processors import apply_logits_processors
from radixserve.engine.sampling_rows import SampleResult, SampleRow


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


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool [..., vocab] from grammars' int32 bitmasks [..., words]; ids past a mask (a model's
    padded vocabulary beyond the tokenizer's) are never allowed."""
    bits = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(-2)[..., :vocab].bool()
    if bits.shape[-1] < vocab:
        bits = torch.cat([bits, bits.new_zeros((*bits.shape[:-1], vocab - bits.shape[-1]))], -1)
    return bits


def _adjusted(logits: torch.Tensor, rows: list[SampleRow],
              mask_op: Callable[..., None] | None) -> torch.Tensor:
    """The logits sampling draws from: a copy where anything changes them (the caller's stay
    untouched). A grammar's mask comes last, after logit_bias: a bias cannot revive a token
    the grammar forbids."""
    adjusted = apply_logits_processors(logits, rows)  # a new tensor when it changes any
    if adjusted is logits and any(r.banned or r.allowed is not None for r in rows):
        adjusted = logits.clone()
    logits = adjusted
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    if masked:
        masks = torch.stack([rows[i].allowed for i in masked])  # type: ignore[misc]
        if mask_op is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            mask_op(logits, masks.contiguous(), torch.tensor(masked, dtype=torch.int64))
        else:
            bits = allowed_tokens(masks, logits.shape[-1])
            logits[masked] = logits[masked].masked_fill_(~bits, float("-inf"))
    for i, row in enumerate(rows):
        if row.banned:
            kept = logits[i].clone() if row.allowed is not None else None
            logits[i, list(row.banned)] = float("-inf")
            if kept is not None and not torch.isfinite(logits[i]).any():
                logits[i] = kept  # the grammar allows only what min_tokens bans: it must end
    return logits


def _rows_of(logits: torch.Tensor, at: list[int]) -> torch.Tensor:
    # A step's rows are usually all greedy or all sampled: then no copy (6 MB at 32 rows).
    return logits if at == list(range(logits.shape[0])) else logits[at]


def _argmax(logits: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor] | None) -> list[int]:
    if op is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        return op(logits).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def _tempered(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The logits sampling draws from: temperature, then top-k and top-p, row by row (the
    caller's logits stay untouched)."""
    temperatures = [row.params.temperature for row in rows]
    scaled = logits if all(t == 1.0 for t in temperatures) else (
        logits / torch.tensor(temperatures).unsqueeze(1))
    for j, row in enumerate(rows):
        p = row.params
        if p.top_k > 0 or p.top_p < 1.0:
            if scaled is logits:
                scaled = logits.clone()
            scaled[j] = _filter_top_k_top_p(scaled[j], p.top_k, p.top_p)
    return scaled


def sampling_distributions(logits: torch.Tensor, rows: list[SampleRow],
                           kernels: SamplerKernels | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's adjusted logits (what returned logprobs are of) and the float64
    probabilities a sampled row draws from: what sampling a token would use, for rules that
    need the whole distribution (speculative verification)."""
    kernels = kernels or SamplerKernels()
    adjusted = _adjusted(logits.float(), rows, kernels.mask)
    return adjusted, torch.softmax(_tempered(adjusted, rows), dim=-1).double()


def top_logprobs(adjusted: torch.Tensor, tokens: list[int],
                 rows: list[SampleRow]) -> list[tuple[float, dict[int, float]] | None]:
    """Per row, the chosen token's log-probability and the top ones asked for (None where a
    row's request asks for none), from adjusted logits."""
    out: list[tuple[float, dict[int, float]] | None] = [None] * len(rows)
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(adjusted[want], dim=-1)
        for at, i in enumerate(want):
            k = rows[i].params.logprobs or 0
            top = torch.topk(lp[at], k) if k else None
            top_map = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
            out[i] = (float(lp[at, tokens[i]]), top_map)
    return out


def _draw(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """One token per row of `logits` by inverse transform: one uniform number from the row's
    generator, found in the cumulative distribution. Why not torch.multinomial: it draws a
    random number per vocabulary entry, for every row; this is one draw a row, the rows
    batched (benchmarks/bench_sampler.py times the two side by side)."""
    # Summed in float64: 49k float32 partial sums would drift by more than small
    # probabilities. (The softmax itself stays float32: in float64 it is much slower.)
    cdf = torch.softmax(_tempered(logits, rows), dim=-1).double().cumsum_(-1)
    uniform = torch.cat([torch.rand(1, dtype=torch.float64, generator=row.generator)
                         for row in rows])
    # The first index whose cumulative mass exceeds u * total: a token of probability 0 adds
    # nothing to the sum, so it is never the first to exceed it.
    found = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True)
    return found.squeeze(1).clamp_(max=logits.shape[-1] - 1).tolist()


@dataclass(frozen=True)
class SamplerKernels:
    """The C++ ops sampling uses where they are built (radixserve/kernels/csrc/layer_ops/), each
    faster than the PyTorch ops it replaces (benchmarks/bench_structured_output.py times the
    masks); None: PyTorch's."""

    # Applies grammar bitmasks to logits rows in one pass (kernels.token_bitmask_op).
    mask: Callable[..., None] | None = None
    # torch.argmax(logits, -1) of float32 rows, the same answers (kernels.argmax_op).
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None


def sample(logits: torch.Tensor, rows: list[SampleRow],
           kernels: SamplerKernels | None = None) -> SampleResult:
    """Samples one token per row of `logits` ([R, vocab], float32), `rows[i]` saying how."""
    kernels = kernels or SamplerKernels()
    logits = _adjusted(logits.float(), rows, kernels.mask)
    tokens = [0] * len(rows)
    picks = ((True, lambda x, _: _argmax(x, kernels.argmax)), (False, _draw))
    for greedy, pick in picks:
        at = [i for i, row in enumerate(rows) if row.params.greedy == greedy]
        if at:
            for i, token in zip(at, pick(_rows_of(logits, at), [rows[i] for i in at]),
                                strict=True):
                tokens[i] = token
    return SampleResult(tokens, top_logprobs(logits, tokens, rows))
