"""A model's decoder layers run by one C++ call per step (radixserve/kernels/decoder_stack.cpp).

The C++ stack calls the kernels the Python layers call, in the same order, so a step gives the
same bits either way; what it saves is the Python and the dispatch between a layer's matmuls,
which a decode step pays cold, after each matmul has streamed its weights through the caches
(on SmolLM2-135M that was a third of the decode time). It runs where every piece has a C++
form: the CPU, float32 or bfloat16, the fused layer ops, each projection's method able to say
how C++ runs it (`LinearMethod.native`) and, per step, every row on the paged attention
kernel. Elsewhere the Python layers run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.kernels import decoder_stack
from radixserve.layers.attention import LayerKV
from radixserve.layers.attention.paged_kernel import whole_step_rows

if TYPE_CHECKING:
    from radixserve.model.llama import ForwardBatch, LlamaModel, Rotary

STACK_DTYPES = (torch.float32, torch.bfloat16)  # what the layer ops compute


@dataclass(frozen=True)
class DecoderStack:
    """The C++ stack of a loaded model, and the dtype it runs in. It holds the weights and
    each projection's path cap as they were at load (nothing changes them after)."""

    stack: torch.ScriptObject
    dtype: torch.dtype

    @staticmethod
    def build(model: LlamaModel, dtype: torch.dtype) -> DecoderStack | None:
        """The model's layers as a C++ stack, or None where some part has no C++ form (the
        model then runs its Python layers)."""
        cfg = model.config
        if model.ops is None or dtype not in STACK_DTYPES:  # (the engine gives ops to CPUs)
            return None
        stack = decoder_stack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                              cfg.head_dim**-0.5)
        if stack is None:
            return None
        for layer in model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for projection in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj,
                               mlp.down_proj):
                native = projection.method.native(projection)
                if native is None:
                    return None
                stack.add_projection(native.kind, native.panels, native.types, native.rows,
                                     native.bias, native.out_features, native.max_path)
            stack.add_norms(layer.input_layernorm.weight.detach(),
                            layer.post_attention_layernorm.weight.detach())
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
