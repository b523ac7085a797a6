"""Attention backends and the one function that chooses them.

Every step, the runner asks the engine's `StepAttention` to `plan` the step once; each layer
then calls `forward(q, k, v, layer_cache, plan, layer)`, `layer` a `LayerAttention` where the
layer has its own sliding window, scale or attention sinks (None: the model's window,
head_dim**-0.5, no sinks). Decode rows and prefill chunks go to one
backend of each role:

| backend | role | runs where | file |
|---|---|---|---|
| `kernel` | decode | CPU, float32/bfloat16, C++ compiler at hand | paged_kernel.py |
| `torch` | decode | anywhere (the CUDA path) | torch_decode.py |
| `kernel` | prefill | as the decode kernel (the same kernel, row by row) | paged_kernel.py |
| `blocked` | prefill | CPU, bfloat16/float16 | blocked_prefill.py |
| `sdpa` | prefill | anywhere | sdpa_prefill.py |

The kernel comes first in both roles: a row's arithmetic is then the same whether it is
decoded or prefilled, in one chunk or several, which makes cache on == cache off exact.

Adding a backend: write one file with a subclass of `base.AttentionBackend` (its `name`, its
`role`, `unavailable(env)` saying where it cannot run, `plan(spans, window)` building its
metadata once per step and window, `forward(q, k, v, cache, metadata, out, scale, sinks)` per
layer), then add one line to
`BACKENDS` below, in preference order: `auto` takes the first of its role that is available.
The model, the runner and the engine do not change.
"""

from __future__ import annotations

from radixserve.layers.attention.base import (
    AttentionBackend,
    AttentionEnv,
    LayerAttention,
    LayerKV,
    SequenceSpan,
    StepAttention,
    StepLayout,
    StepPlan,
)
from radixserve.layers.attention.blocked_prefill import BlockedPrefill
from radixserve.layers.attention.paged_kernel import PagedDecodeKernel, PagedPrefillKernel
from radixserve.layers.attention.sdpa_prefill import SdpaPrefill
from radixserve.layers.attention.torch_decode import TorchDecode

# In preference order within each role.
BACKENDS: list[type[AttentionBackend]] = [
    PagedDecodeKernel,
    TorchDecode,
    PagedPrefillKernel,
    BlockedPrefill,
    SdpaPrefill,
]


def backend_names(role: str) -> tuple[str, ...]:
    return tuple(b.name for b in BACKENDS if b.role == role)


def choose_backend(role: str, name: str, env: AttentionEnv,
                   setting: str | None = None) -> AttentionBackend:
    """The backend of `role` called `name`, or with "auto" the first available one; a clear
    ValueError (naming the `setting` that asked for it) where the named one cannot run here."""
    candidates = [b for b in BACKENDS if b.role == role and name in ("auto", b.name)]
    if not candidates:
        raise ValueError(f"unknown {role} attention backend {name!r}; "
                         f"known: auto, {', '.join(backend_names(role))}")
    for backend in candidates:
        reason = backend.unavailable(env)
        if reason is None:
            return backend(env)
        if name != "auto":
            raise ValueError(f"{setting or role + ' attention backend'}={name!r} needs {reason}")
    raise ValueError(f"no {role} attention backend runs here")  # the last one runs anywhere


def choose_attention(env: AttentionEnv, decode: str = "auto",
                     prefill: str = "auto") -> StepAttention:
    """The engine's attention: one decode and one prefill backend, from the settings
    `attention_backend` and `prefill_attention_backend`."""
    return StepAttention(decode=choose_backend("decode", decode, env, "attention_backend"),
                         prefill=choose_backend("prefill", prefill, env,
                                                "prefill_attention_backend"))


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionEnv",
    "LayerAttention",
    "LayerKV",
    "SequenceSpan",
    "StepAttention",
    "StepLayout",
    "StepPlan",
    "backend_names",
    "choose_attention",
    "choose_backend",
]
