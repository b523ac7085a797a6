"""Adjustments of next-token logits before sampling that a request asks for: OpenAI's
logit_bias, presence and frequency penalties, vLLM's repetition_penalty.

They apply in vLLM's order, each to the result of the one before:
1. repetition_penalty p, on every token in the prompt or the output so far: a positive logit
   is divided by p, a negative one multiplied by it (both move it down for p > 1).
2. frequency and presence penalties, on the output's tokens only (OpenAI's definition):
   logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0).
3. logit_bias, added last, so a bias of +-100 decides a token whatever the penalties did.
All of this precedes temperature, top-k and top-p, and greedy rows take their argmax of the
adjusted logits; the logprobs returned are the adjusted distribution's.

Most batches ask for none of it: they cost one cheap check per row and get `logits` back.
"""

from __future__ import annotations

import torch

from radixserve.engine.sampling_rows import SampleRow
from radixserve.sampling_params import SamplingParams


def _asks(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty != 1 or (
        params.presence_penalty != 0 or params.frequency_penalty != 0)


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The logits ([R, vocab]) with every row's adjustments, `rows[i]` describing row i.

    `logits` itself is never changed: it is returned as is when no row asks for anything, and
    otherwise a new tensor is. Only the entries of tokens a row has seen or biased are
    touched, so the cost follows the histories' lengths, not the vocabulary's.
    """
    if not any(_asks(row.params) for row in rows):
        return logits
    adjusted = logits.clone(memory_format=torch.contiguous_format)
    flat = adjusted.view(-1)  # entry row * vocab + token
    _repetition_penalty(flat, logits.shape[-1], rows)
    _frequency_presence_penalties(flat, logits.shape[-1], rows)
    _logit_bias(flat, logits.shape[-1], rows)
    return adjusted


def _flat_positions(which: list[int], sequences: list[list[int]], vocab: int,
                    device: torch.device) -> torch.Tensor:
    """Index into the flattened logits of every token of `sequences[k]` in row `which[k]`."""
    tokens = torch.cat([torch.tensor(seq, dtype=torch.long) for seq in sequences])
    lengths = torch.tensor([len(seq) for seq in sequences])
    starts = torch.repeat_interleave(torch.tensor(which, dtype=torch.long) * vocab, lengths)
    return (starts + tokens).to(device)


def _repetition_penalty(flat: torch.Tensor, vocab: int, rows: list[SampleRow]) -> None:
    which = [i for i, row in enumerate(rows)
             if row.params.repetition_penalty != 1 and row.token_ids]
    if not which:
        return
    # Each distinct token once: the penalty applies per token, not per occurrence.
    seen = torch.unique(_flat_positions(which, [rows[i].token_ids or [] for i in which], vocab,
                                        flat.device))
    penalty = torch.tensor([row.params.repetition_penalty for row in rows],
                           dtype=flat.dtype, device=flat.device)[seen // vocab]
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / penalty, values * penalty)


def _frequency_presence_penalties(flat: torch.Tensor, vocab: int, rows: list[SampleRow]) -> None:
    which = [i for i, row in enumerate(rows)
             if (row.params.frequency_penalty != 0 or row.params.presence_penalty != 0)
             and len(row.token_ids or []) > row.prompt_len]
    if not which:
        return  # no output yet: nothing to penalise
    outputs = [(rows[i].token_ids or [])[rows[i].prompt_len:] for i in which]
    present, counts = torch.unique(_flat_positions(which, outputs, vocab, flat.device),
                                   return_counts=True)
    row_of = present // vocab
    frequency = torch.tensor([row.params.frequency_penalty for row in rows],
                             dtype=flat.dtype, device=flat.device)[row_of]
    presence = torch.tensor([row.params.presence_penalty for row in rows],
                            dtype=flat.dtype, device=flat.device)[row_of]
    flat[present] -= frequency * counts + presence


def _logit_bias(flat: torch.Tensor, vocab: int, rows: list[SampleRow]) -> None:
    at = [(i * vocab + token, value) for i, row in enumerate(rows)
          for token, value in (row.params.logit_bias or {}).items()]
    if not at:
        return
    positions, values = zip(*at, strict=True)
    flat.index_put_((torch.tensor(positions, device=flat.device),),
                    torch.tensor(values, dtype=flat.dtype, device=flat.device), accumulate=True)
