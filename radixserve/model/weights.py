"""Puts a model's weights into its modules: HF names mapped to ours, q/k/v and gate/up fused
into one matrix each, quantized blocks handed to the layers that run them, floats cast to the
run's dtype; then each projection prepared for its method and the C++ decoder stack built.
Reading the files into HF-named weights is radixserve/model/loader.py's part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from radixserve.layers.linear import Linear, LinearMethod, PanelEmbedding
from radixserve.layers.quantized import QuantizedEmbedding
from radixserve.layers.quantized_weight import EXECUTED_TYPES, PackedParts, QuantizedWeight
from radixserve.model.config import ModelConfig
from radixserve.model.decoder_stack import DecoderStack
from radixserve.model.llama import LlamaModel, rope_inv_freq

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps

# A fused projection's parts, or a tensor as it is.
StateValue = torch.Tensor | QuantizedWeight | list[torch.Tensor | QuantizedWeight]


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight],
                linear: LinearMethod, ops: LayerOps | None, dtype: torch.dtype,
                progress: bool = False) -> LlamaModel:
    """The model of `config` holding `weights` (HF names, as the loader reads them) in
    `dtype`, on the CPU. Built on the meta device first, so no weight is allocated twice."""
    with torch.device("meta"):
        model = LlamaModel(config, linear, ops)
    load_weights(model, weights, dtype, progress)
    return model


def load_weights(model: LlamaModel, weights: dict[str, torch.Tensor | QuantizedWeight],
                 dtype: torch.dtype, progress: bool = False) -> None:
    """Takes HF-named weights, fusing q/k/v and gate/up; casts float ones to `dtype`.
    `QuantizedWeight`s (GGUF blocks the linear method executes) are packed for the
    kernel, layer by layer (with a progress bar if asked). Empties `weights`, so that
    each matrix's blocks are freed once packed: a model's blocks and panels never all
    exist at once."""
    state, tied = _our_names(model.config, weights)
    weights.clear()
    floats = _take_quantized(model, state, dtype, tied, progress)
    missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    missing = [m for m in missing if m != "inv_freq"]
    if missing or unexpected:
        raise ValueError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
    model.to(dtype)
    model.inv_freq = rope_inv_freq(model.config).to(model.norm.weight.device)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.prepare(module)
    if tied and isinstance(model.embed_tokens, nn.Embedding) and \
            getattr(model.lm_head, "panels", None) is not None:
        # The head was repacked into panels (float-panels): read the table from them
        # rather than hold it twice.
        model.embed_tokens = PanelEmbedding(model.lm_head, dtype)
    model.stack = DecoderStack.build(model.config, model.ops,
                                     [layer.stack_layer() for layer in model.layers], dtype)


def _our_names(cfg: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight]
               ) -> tuple[dict[str, StateValue], bool]:
    """The weights under our modules' names, fused projections as lists of their parts, and
    whether the LM head is the embedding table (tied)."""
    embed = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight")
    tied = head is None or cfg.tie_word_embeddings
    state: dict[str, StateValue] = {
        "embed_tokens.weight": embed,
        "norm.weight": weights["model.norm.weight"],
        "lm_head.weight": embed if tied else head,
    }
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        state[ours + "input_layernorm.weight"] = weights[p + "input_layernorm.weight"]
        state[ours + "post_attention_layernorm.weight"] = weights[
            p + "post_attention_layernorm.weight"
        ]
        state[ours + "self_attn.qkv_proj.weight"] = [
            weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        if cfg.attention_bias:
            state[ours + "self_attn.qkv_proj.bias"] = [
                weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]
        state[ours + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"]
        state[ours + "mlp.gate_up_proj.weight"] = [
            weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
        state[ours + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"]
    return state, tied


def _take_quantized(model: LlamaModel, state: dict[str, StateValue], dtype: torch.dtype,
                    tied: bool, progress: bool) -> dict[str, torch.Tensor]:
    """Hands quantized weights to their layers and returns the float state; fused parts
    (lists) are concatenated, or kept as quantized parts where all of them are."""
    floats: dict[str, torch.Tensor] = {}
    quantized = any(isinstance(p, QuantizedWeight) for value in state.values()
                    for p in (value if isinstance(value, list) else [value]))
    for name in tqdm(list(state), desc="Packing weights", unit="tensor",
                     disable=not (progress and quantized)):
        value = state.pop(name)  # the only reference left: freed once packed
        parts = value if isinstance(value, list) else [value]
        if all(isinstance(p, QuantizedWeight) for p in parts) and name.endswith(".weight"):
            _load_quantized(model, name.removesuffix(".weight"), parts, dtype, tied)
        elif isinstance(value, torch.Tensor):
            floats[name] = value  # as it is: a copy would double a large model's peak
        else:  # a fused float (or float and quantized) projection or bias
            floats[name] = torch.cat([
                p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])
    return floats


def _load_quantized(model: LlamaModel, module: str, parts: list[QuantizedWeight], dtype: torch.dtype,
                    tied: bool) -> None:
    """Hands one module's quantized blocks (a fused projection's parts) to it."""
    cfg = model.config
    if module == "embed_tokens":
        table = parts[0]
        if (table.rows, table.cols) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"token embedding {table.rows}x{table.cols} does not match the "
                             f"model's vocabulary x hidden size {cfg.vocab_size}x"
                             f"{cfg.hidden_size}")
        model.embed_tokens = QuantizedEmbedding(table, dtype)
    elif module == "lm_head" and tied and isinstance(model.embed_tokens, QuantizedEmbedding):
        model.lm_head.share_packed(model.embed_tokens.packed)  # one copy of a tied table
    else:
        model.get_submodule(module).load_quantized(parts)


def weight_formats(model: LlamaModel) -> dict[str, int]:
    """Bytes of weights a model holds, by format: GGUF panels by type (a table shared by the
    embedding and a tied head counted once), float tensors by dtype."""
    type_names = {type_id: name for name, type_id in EXECUTED_TYPES.items()}
    held: dict[str, int] = {}
    tables: dict[int, PackedParts] = {}
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedParts):
            tables[id(packed)] = packed
    for packed in tables.values():
        for panels, type_id in zip(packed.panels, packed.types, strict=True):
            name = type_names[type_id]
            held[name] = held.get(name, 0) + panels.numel()
    for tensor in model.parameters():
        name = str(tensor.dtype).removeprefix("torch.")
        held[name] = held.get(name, 0) + tensor.numel() * tensor.element_size()
    return held
