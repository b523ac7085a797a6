"""A decoder layer's small ops in one call each (csrc/layer_ops/), sampling's row ops, and the
decoder stack that runs a model's layers by one call (csrc/decoder_stack/).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from radixserve.kernels.build import load_library


class LayerOps:
    """A decoder layer's small ops (csrc/layer_ops/), each one call instead of the half-dozen
    PyTorch kernels it is made of: at decode their dispatch, not their arithmetic, is the cost.
    CPU tensors, float32 or bfloat16 computed in float32."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's LlamaRMSNorm of x [M, H] (contiguous) with weight [H] in x's dtype."""
        return torch.ops.radixserve.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + d, RMSNorm of it) for x and d [M, H] (contiguous): a residual add and the norm
        after it, in one call; the sum rounded to the dtype as PyTorch's add rounds it."""
        return torch.ops.radixserve.add_rms_norm(x, d, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """F.silu(gate) * up of gate_up [M, 2I] (gate first), the same bits, in one call."""
        return torch.ops.radixserve.silu_mul(gate_up)

    def rotary_embedding_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          heads: int) -> None:
        """Rotates heads [0, heads) of qkv [T, all heads, D] (contiguous) in place, "rotate
        half" style; cos and sin are float32 [T, D / 2]."""
        torch.ops.radixserve.rotary_embedding_(qkv, cos, sin, heads)


def decoder_stack(heads: int, kv_heads: int, head_dim: int, eps: float,
                  scale: float) -> torch.ScriptObject | None:
    """An empty `torch.classes.radixserve.DecoderStack` (csrc/decoder_stack/), None where the
    kernels cannot be built: a model's decoder layers run by one call, `forward(x, cos, sin,
    k_caches, v_caches, write_slots, slots, begins, lengths, attention_path, output_rows)`
    (output_rows: the rows whose last-layer output it returns, None for all), after
    `add_projection` (qkv, o, gate_up, down) and `add_norms` for each layer."""
    if not load_library():
        return None
    return torch.classes.radixserve.DecoderStack(heads, kv_heads, head_dim, eps, scale)


@functools.cache
def layer_ops() -> LayerOps | None:
    """The layer ops, built if needed; None where they cannot be."""
    return LayerOps() if load_library() else None


def token_bitmask_op() -> Callable[..., None] | None:
    """`torch.ops.radixserve.apply_token_bitmask_` (csrc/layer_ops/), None where the kernels
    cannot be built. Signature: (logits float32 [R, vocab], masks int32 [M, words], rows int64
    [M]) -> None: row rows[m] keeps only the tokens whose bit is set in mask m."""
    return torch.ops.radixserve.apply_token_bitmask_ if load_library() else None


def argmax_op() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`torch.ops.radixserve.argmax_rows` (csrc/layer_ops/), None where the kernels cannot be
    built: torch.argmax(logits, -1) of float32 [R, V] (the same indices, NaN first as torch),
    in one pass a row."""
    return torch.ops.radixserve.argmax_rows if load_library() else None


@functools.cache  # looked up by every layer of every step
def kv_write_op() -> Callable[..., None] | None:
    """`torch.ops.radixserve.write_kv_` (csrc/layer_ops/), None where the kernels cannot be
    built: (k_cache, v_cache [Hkv, S, D] contiguous, slots int64 [T], k, v [T, Hkv, D] in the
    caches' dtype, last dim contiguous) -> None, caches[h, slots[t]] = rows[t, h]."""
    return torch.ops.radixserve.write_kv_ if load_library() else None
