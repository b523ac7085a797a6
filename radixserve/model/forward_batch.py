"""What one forward step hands the model's layers: the batch's tokens and how they attend
(`ForwardBatch`, built by the runner), and the step's rotary angles (`Rotary`, made once per
step by the model). Both the Python layers and the C++ decoder stack read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.layers.attention import StepAttention, StepPlan


@dataclass(frozen=True)
class ForwardBatch:
    """One step's tokens and how they attend. Rows [0, D) are decode tokens (one per
    request), prefill chunks follow; `attention.forward(..., attention_plan)` knows which."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    # [R] rows of hidden_states' result whose next-token logits are wanted
    logit_rows: torch.Tensor
    attention: StepAttention
    attention_plan: StepPlan
    # [O] ascending rows whose last-layer output hidden_states returns; None: every row. The
    # other rows' last layer stops once their K/V is written: nothing reads the rest.
    output_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class Rotary:
    """A step's rotary angles: cos and sin [T, D / 2] in float32."""

    cos: torch.Tensor
    sin: torch.Tensor
    # PyTorch's rotation wants them [T, 1, D] in the model's dtype: made once per step.
    widened: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated "rotate half" style, in x's dtype (PyTorch's ops)."""
        if x.dtype not in self.widened:
            self.widened[x.dtype] = tuple(  # type: ignore[assignment]
                torch.cat((t, t), dim=-1).unsqueeze(1).to(x.dtype) for t in (self.cos, self.sin))
        cos, sin = self.widened[x.dtype]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
