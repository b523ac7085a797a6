"""A model's decoder layers run by one C++ call per step (radixserve/kernels/csrc/decoder_stack/).

The C++ stack calls the kernels the Python layers call, in the same order, so a step gives the
same bits either way; what it saves is the Python and the dispatch between a layer's matmuls,
which a decode step pays cold, after each matmul has streamed its weights through the caches:
the smaller the model, the larger that share of its decode time (benchmarks/bench_engine.py
measures decode). It runs where every piece has a C++
form: the CPU, float32 or bfloat16, the fused layer ops, each projection's method able to say
how C++ runs it (`LinearMethod.native`) and, per step, every row on the paged attention
kernel. Elsewhere the Python layers run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixserve.kernels import LayerOps, decoder_stack
from radixserve.layers.attention import LayerKV
from radixserve.layers.attention.paged_kernel import whole_step_rows
from radixserve.layers.linear import Linear
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch, Rotary

STACK_DTYPES = (torch.float32, torch.bfloat16)  # what the layer ops compute


class StackLayer(NamedTuple):
    """One decoder layer as the C++ stack takes it: its projections, in the order a layer
    runs them, and its two norms' weights."""

    qkv_proj: Linear
    o_proj: Linear
    gate_up_proj: Linear
    down_proj: Linear
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


@dataclass(frozen=True)
class DecoderStack:
    """The C++ stack of a loaded model, and the dtype it runs in. It holds the weights and
    each projection's path cap as they were at load (nothing changes them after)."""

    stack: torch.ScriptObject
    dtype: torch.dtype

    @staticmethod
    def build(cfg: ModelConfig, ops: LayerOps | None, layers: Iterable[StackLayer],
              dtype: torch.dtype) -> DecoderStack | None:
        """A loaded model's layers as a C++ stack, or None where some part has no C++ form
        (the model then runs its Python layers)."""
        if ops is None or dtype not in STACK_DTYPES:  # (the engine gives ops to CPUs)
            return None
        stack = decoder_stack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                              cfg.head_dim**-0.5)
        if stack is None:
            return None
        for layer in layers:
            for projection in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                               layer.down_proj):
                native = projection.method.native(projection)
                if native is None:
                    return None
                stack.add_projection(native.kind, native.panels, native.types, native.rows,
                                     native.bias, native.out_features, native.max_path)
            stack.add_norms(layer.input_norm.detach(), layer.post_attention_norm.detach())
        return DecoderStack(stack, dtype)

    def run(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch,
            caches: list[LayerKV]) -> torch.Tensor | None:
        """The layers' output for the step's embedded tokens x [T, hidden] at the batch's
        output rows (before the final norm), its K/V written to `caches`; None where this
        step's attention is not all on the paged kernel, or the pool is not in the model's
        dtype (run the Python layers)."""
        whole = whole_step_rows(batch.attention, batch.attention_plan)
        if (whole is None or not x.is_cpu or x.dtype != self.dtype
                or caches[0].k.dtype != self.dtype):
            return None
        rows, path = whole
        return self.stack.forward(x, rotary.cos, rotary.sin, [c.k for c in caches],
                                  [c.v for c in caches], batch.attention_plan.write_slots,
                                  rows.slots, rows.begins, rows.lengths, path,
                                  batch.output_rows)
