"""Prefill attention through PyTorch's scaled_dot_product_attention: any device, any dtype.

A chunk that starts at position 0 attends to its own keys (plain causal); a later chunk reads
its cached context from the pool and carries an explicit mask. Attention sinks, which SDPA
does not take, join as one more key: zero K and V, its score added by a float mask.
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

    def plan(self, spans: list[SequenceSpan], window: int | None) -> list[PrefillSpan]:
        return [self._span(span, window) for span in spans]

    def _span(self, span: SequenceSpan, window: int | None) -> PrefillSpan:
        device = self.env.device
        first, context = span.first, span.context
        windowed = bool(window) and context > window  # type: ignore[operator]
        # Under a sliding window no row of the chunk sees a position before `lo`: those keys
        # are neither gathered nor scored (a 400-token chunk after 5,000 cached tokens reads
        # 912 keys in a 512-token window's layer, not 5,400).
        lo = max(first - window + 1, 0) if windowed and first else 0  # type: ignore[operator]
        mask = None
        if first != 0 or windowed:
            rows = torch.arange(first, context).unsqueeze(1)
            cols = torch.arange(lo, context).unsqueeze(0)
            mask = cols <= rows
            if window:
                mask &= cols > rows - window
            mask = mask.to(device)
        return PrefillSpan(
            start=span.start,
            length=span.length,
            context=None if first == 0
            else self.gathers.plan([span.table.slots[lo:context]], context - lo),
            mask=mask,
            plain_causal_from=None if windowed else first,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor, scale: float,
                sinks: torch.Tensor | None) -> None:
        assert isinstance(metadata, list)
        for span in metadata:
            rows = slice(span.start, span.start + span.length)
            if span.context is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:  # [heads, context, dim], straight from the head-major pool
                keys, values = span.context.take(cache.k), span.context.take(cache.v)
            if sinks is None:
                out[rows] = self.attend(q[rows], keys, values, span, scale)
            else:
                out[rows] = self.attend_with_sinks(q[rows], keys, values, span, scale, sinks)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               span: PrefillSpan, scale: float) -> torch.Tensor:
        """q [n, H, D] against keys/values [Hkv, context, D]; returns [n, H, D]."""
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)

    def attend_with_sinks(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          span: PrefillSpan, scale: float, sinks: torch.Tensor) -> torch.Tensor:
        """As `attend`, each query head's sink one more term of its softmax's denominator: a
        zero key (score 0) whose mask adds the sink, with a zero value."""
        n, context = q.shape[0], keys.shape[1]
        allowed = span.mask
        if allowed is None:  # plain causal from the chunk's first position
            first = context - n
            allowed = (torch.arange(context, device=q.device)[None, :]
                       <= torch.arange(first, context, device=q.device)[:, None])
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~allowed, float("-inf"))
        heads = q.shape[1]
        bias = torch.cat((bias.expand(heads, n, context),
                          sinks.to(q.device, q.dtype)[:, None, None].expand(heads, n, 1)), dim=-1)
        zero = keys.new_zeros(keys.shape[0], 1, keys.shape[2])
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            torch.cat((keys, zero), dim=1).unsqueeze(0),
            torch.cat((values, zero), dim=1).unsqueeze(0),
            attn_mask=bias.unsqueeze(0),
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
