"""What passes between the runner, the logits processors and the sampler: one `SampleRow` per
logits row (what sampling needs to know of its request) in, one `SampleResult` per step out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What sampling one row needs to know of its request."""

    params: SamplingParams
    generator: torch.Generator | None  # None: the global RNG
    # Tokens the row may not produce yet (EOS before min_tokens), or None.
    banned: set[int] | None = None
    # The request's tokens so far, prompt then output (penalties read them).
    token_ids: list[int] | None = None
    prompt_len: int = 0
    # The grammar's allowed tokens as a bitmask (int32 words, bit t % 32 of word t // 32), or
    # None when the request has no structured output.
    allowed: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, top-k {token: logprob}) when asked for, else None.
    logprobs: list[tuple[float, dict[int, float]] | None]
