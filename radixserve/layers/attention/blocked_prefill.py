"""Blocked causal prefill attention for bfloat16/float16 on CPU.

PyTorch's CPU flash-attention kernel computes bfloat16/float16 in float32 matmuls (as slow
in either dtype), so half precision on CPU runs this blocked attention on the fast bfloat16
matmuls instead. Where the CPU has no native bfloat16 dot products (AVX2-only machines),
those matmuls are emulated and this attention is far slower than SDPA, so it is offered only
where they exist. Chunks cut by a sliding window, and layers with attention sinks, keep SDPA
(with an explicit mask, and a sink key).
"""

from __future__ import annotations

import torch

from radixserve.layers.attention.base import AttentionEnv
from radixserve.layers.attention.sdpa_prefill import PrefillSpan, SdpaPrefill


class BlockedPrefill(SdpaPrefill):
    name = "blocked"
    role = "prefill"
    block = 256  # query rows per block: a block's scores stay in cache

    @classmethod
    def unavailable(cls, env: AttentionEnv) -> str | None:
        if env.device.type != "cpu" or env.dtype not in (torch.bfloat16, torch.float16):
            return "a CPU device and bfloat16 or float16 (elsewhere SDPA is as fast or faster)"
        if not env.native_bf16:
            return ("a CPU with AVX512-BF16 or AMX (without them its half-precision matmuls "
                    "are emulated and SDPA is faster)")
        return None

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               span: PrefillSpan, scale: float) -> torch.Tensor:
        if span.plain_causal_from is None:
            return super().attend(q, keys, values, span, scale)
        return self.causal(q, keys, values, span.plain_causal_from, scale)

    def causal(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               first: int, scale: float | None = None) -> torch.Tensor:
        """Causal attention of a prefill chunk whose first query sits at position `first`.

        q: [n, H, D]; keys/values: [Hkv, first + n, D]. A block of queries reads only the
        keys up to its own last position (the causal upper triangle is never computed), and
        the query heads of one KV head are stacked into a single matmul instead of repeating
        K and V. scale: None for head_dim**-0.5.
        """
        env = self.env
        n = q.shape[0]
        heads, dim = env.num_kv_heads, env.head_dim
        groups = env.num_heads // heads
        # Scaling q once (n x H x D values) is far cheaper than scaling every score.
        q_by_head = (q * (env.scale if scale is None else scale)).transpose(0, 1).reshape(heads, groups, n, dim)
        out = torch.empty(heads, groups, n, dim, dtype=q.dtype, device=q.device)
        block = self.block
        above_diagonal = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
        keys_t = keys.transpose(1, 2)
        for s in range(0, n, block):
            e = min(n, s + block)
            rows, end = e - s, first + e
            qb = q_by_head[:, :, s:e].reshape(heads, groups * rows, dim)
            scores = torch.bmm(qb, keys_t[:, :, :end]).view(heads, groups, rows, end)
            scores[..., end - rows :].masked_fill_(above_diagonal[:rows, :rows], float("-inf"))
            # Softmax reads bfloat16 scores and accumulates in float32 internally.
            probs = torch.softmax(scores, dim=-1).view(heads, groups * rows, end)
            out[:, :, s:e] = torch.bmm(probs, values[:, :end]).view(heads, groups, rows, dim)
        return out.view(env.num_heads, n, dim).transpose(0, 1)
