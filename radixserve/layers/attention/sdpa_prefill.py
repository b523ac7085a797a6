"""Prefill attention through PyTorch's scaled_dot_product_attention: any device, any dtype.

A chunk that starts at position 0 attends to its own keys (plain causal); a later chunk reads
its cached context from the pool and carries an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base import AttentionBackend, AttentionEnv, LayerKV, SequenceSpan
from radixserve.layers.attention.gather import GatherPlanner, KVGather


@dataclass(frozen=True)
class PrefillSpan:
    """One request's prefill chunk inside the flattened batch."""

    start: int  # first row of the chunk in the batch
    length: int  # chunk tokens
    context: KVGather | None  # all context tokens (cached + chunk); None: no cache to read
    mask: torch.Tensor | None  # [length, context] bool, None when plain causal works
    # The chunk's first position when its mask is plain causal over the whole context (no
    # sliding window cuts it): lets attention build the mask itself, block by block.
    plain_causal_from: int | None


class SdpaPrefill(AttentionBackend):
    name = "sdpa"
    role = "prefill"

    def __init__(self, env: AttentionEnv) -> None:
        super().__init__(env)
        self.gathers = GatherPlanner(env.num_kv_heads, env.num_slots, env.device)

    def plan(self, spans: list[SequenceSpan]) -> list[PrefillSpan]:
        return [self._span(span) for span in spans]

    def _span(self, span: SequenceSpan) -> PrefillSpan:
        window, device = self.env.window, self.env.device
        first, context = span.first, span.context
        windowed = bool(window) and context > window  # type: ignore[operator]
        mask = None
        if first != 0 or windowed:
            rows = torch.arange(first, context).unsqueeze(1)
            cols = torch.arange(context).unsqueeze(0)
            mask = cols <= rows
            if window:
                mask &= cols > rows - window
            mask = mask.to(device)
        return PrefillSpan(
            start=span.start,
            length=span.length,
            context=None if first == 0
            else self.gathers.plan([span.table.slots[:context]], context),
            mask=mask,
            plain_causal_from=None if windowed else first,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor) -> None:
        assert isinstance(metadata, list)
        for span in metadata:
            rows = slice(span.start, span.start + span.length)
            if span.context is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:  # [heads, context, dim], straight from the head-major pool
                keys, values = span.context.take(cache.k), span.context.take(cache.v)
            out[rows] = self.attend(q[rows], keys, values, span)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               span: PrefillSpan) -> torch.Tensor:
        """q [n, H, D] against keys/values [Hkv, context, D]; returns [n, H, D]."""
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.env.scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
