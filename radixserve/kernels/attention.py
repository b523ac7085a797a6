"""Attention over the paged KV pool for decode and prefill rows (csrc/attention/): the op,
and which vector path it runs on this CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.kernels.build import load_library
from radixserve.kernels.paths import best_path


def paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.paged_attention`, built if needed; None where it cannot be.

    Signature: (q [R, H, D], k_cache [Hkv, S, D], v_cache, slots int32 [N], begins int64 [R],
    lengths int64 [R], scale, max_path) -> [R, H, D]: row r attends to slots[begins[r] :
    begins[r] + lengths[r]]; decode and prefill rows alike, a row's result bitwise the same
    whatever else is in the call. See csrc/attention/attention.cpp; `attention_path()` says which
    vector path (an index of `path_names("attention")`) this CPU runs.
    """
    return torch.ops.radixserve.paged_attention if load_library() else None


def attention_path() -> int:
    """The best vector path of paged_attention on this CPU (an index of
    `path_names("attention")`); 0 where the kernels cannot be built."""
    return best_path("attention")


def attention_path_for(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                       max_path: int) -> int:
    """The path paged_attention runs at for this pool dtype and attention shape, capped at
    `max_path` (an index of `path_names("attention")`): not every path takes every shape."""
    if not load_library():
        return 0
    return torch.ops.radixserve.attention_path_for(
        dtype == torch.bfloat16, num_heads // num_kv_heads, head_dim, max_path)
