"""Puts a model's weights into its modules: HF names mapped to ours, q/k/v and gate/up fused
into one matrix each, quantized blocks handed to the layers that run them, floats cast to the
run's dtype; then each projection prepared for its method and the C++ decoder stack built.
Reading the files into HF-named weights is radixserve/model/loader.py's part.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from radixserve.layers.linear import Linear, LinearMethod, PanelEmbedding
from radixserve.layers.quantized import QuantizedEmbedding
from radixserve.layers.quantized_weight import EXECUTED_TYPES, PackedParts, QuantizedWeight
from radixserve.model.config import ModelConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.decoder_stack import DecoderStack
from radixserve.model.families import family_named
from radixserve.model.family import Weights

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps

logger = logging.getLogger(__name__)

# A fused projection's parts, or a tensor as it is.
StateValue = torch.Tensor | QuantizedWeight | list[torch.Tensor | QuantizedWeight]


def build_model(config: ModelConfig, weights: Weights, linear: LinearMethod,
                ops: LayerOps | None, dtype: torch.dtype, progress: bool = False,
                max_context: int | None = None) -> DecoderModel:
    """The model of `config` (its family's class) holding `weights` (HF names, as the loader
    reads them) in `dtype`, on the CPU, for contexts up to `max_context` tokens (None: the
    model's own length). Built on the meta device first, so no weight is allocated twice."""
    with torch.device("meta"):
        model = family_named(config.family).model(config, linear, ops, max_context)
    load_weights(model, weights, dtype, progress)
    return model


def load_weights(model: DecoderModel, weights: Weights, dtype: torch.dtype,
                 progress: bool = False) -> None:
    """Takes HF-named weights, fusing q/k/v and gate/up; casts float ones to `dtype`.
    `QuantizedWeight`s (GGUF blocks the linear method executes) are packed for the
    kernel, layer by layer (with a progress bar if asked). Empties `weights`, so that
    each matrix's blocks are freed once packed: a model's blocks and panels never all
    exist at once. Then builds the C++ decoder stack where the layers allow it."""
    state, tied = _our_names(model, weights)
    weights.clear()
    floats = _take_quantized(model, state, dtype, tied, progress)
    missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.prepare(module)
    if tied and isinstance(model.embed_tokens, nn.Embedding) and \
            getattr(model.lm_head, "panels", None) is not None:
        # The head was repacked into panels (float-panels): read the table from them
        # rather than hold it twice.
        model.embed_tokens = PanelEmbedding(model.lm_head, dtype)
    blocker = model.stack_blocker()
    if blocker is None:
        model.stack = DecoderStack.build(model.config, model.ops, model.stack_layers(), dtype)
    else:
        logger.info("%s: the decoder layers run in Python (the C++ decoder stack has no %s)",
                    model.config.architecture, blocker)


def _our_names(model: DecoderModel, weights: Weights) -> tuple[dict[str, StateValue], bool]:
    """The weights under our modules' names (HF's without "model."), fused projections as
    lists of their parts (the model's `fused_projections`), and whether the LM head is the
    embedding table (tied)."""
    cfg, fused_parts = model.config, model.fused_projections
    head = weights.get("lm_head.weight")
    tied = head is None or cfg.tie_word_embeddings
    part_of = {part: (fused, i) for fused, parts in fused_parts.items()
               for i, part in enumerate(parts)}
    state: dict[str, StateValue] = {}
    for name, value in weights.items():
        if name == "lm_head.weight":
            continue
        ours = name.removeprefix("model.")
        if ours.startswith("layers."):
            _, layer, rest = ours.split(".", 2)
            module, _, suffix = rest.rpartition(".")
            if module in part_of:
                fused, index = part_of[module]
                key = f"layers.{layer}.{fused}.{suffix}"
                parts = state.setdefault(key, [None] * len(fused_parts[fused]))  # type: ignore[list-item]
                parts[index] = value  # type: ignore[index]
                continue
        state[ours] = value
    for key, value in state.items():
        if isinstance(value, list) and any(part is None for part in value):
            fused = key.split(".", 2)[2].rpartition(".")[0]
            raise ValueError(f"weight mismatch: {key} needs all of {', '.join(fused_parts[fused])}")
    state["lm_head.weight"] = state["embed_tokens.weight"] if tied else head
    return state, tied


def _take_quantized(model: DecoderModel, state: dict[str, StateValue], dtype: torch.dtype,
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


def _load_quantized(model: DecoderModel, module: str, parts: list[QuantizedWeight], dtype: torch.dtype,
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


def weight_formats(model: DecoderModel) -> dict[str, int]:
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
