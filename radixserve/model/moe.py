"""The mixture-of-experts block that takes a dense MLP's place in MoE families: a router
scores every expert per token, keeps the top k with the family's normalisation (`Routing`),
and the layer's experts (radixserve/layers/experts.py) compute the weighted sum of the chosen
ones' outputs, grouped by expert so each chosen expert's weights are read once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from radixserve.layers.experts import ExpertActivation, Experts, ExpertsMethod
from radixserve.layers.linear import Linear, LinearMethod
from radixserve.layers.quantized_weight import QuantizedWeight
from radixserve.model.family import Weights

# One projection of a layer's experts: all experts' matrix, or one matrix per expert.
ExpertPart = torch.Tensor | QuantizedWeight | list[torch.Tensor | QuantizedWeight]


@dataclass(frozen=True)
class Routing:
    """How router logits become each token's `top_k` experts and their weights:
    - "softmax_topk" (Qwen3-MoE, Qwen2-MoE, Mixtral): softmax over all experts in float32,
      the top k probabilities, divided by their sum where `normalize` (norm_topk_prob);
    - "topk_softmax" (gpt-oss): the top k logits, then a softmax over those k."""

    rule: str
    top_k: int
    normalize: bool = False

    RULES: ClassVar[tuple[str, ...]] = ("softmax_topk", "topk_softmax")

    def __post_init__(self) -> None:
        if self.rule not in self.RULES:
            raise ValueError(f"routing rule {self.rule!r} is not one of {self.RULES}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (got {self.top_k})")

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int64 [T, k], weights float32 [T, k]) of router logits [T, experts]."""
        if self.rule == "topk_softmax":
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1).float()
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top


@dataclass(frozen=True)
class MoESpec:
    """A family's MoE block: its experts' count and FFN size, routing, expert activation and
    which projections carry biases."""

    num_experts: int
    expert_inter: int
    routing: Routing
    activation: ExpertActivation = ExpertActivation()
    router_bias: bool = False
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.routing.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.routing.top_k} must be within 1..{self.num_experts} "
                             "experts")


class MoEBlock(nn.Module):
    """Router (`gate`, a projection hidden -> experts) and experts; forward(x [T, hidden]) ->
    [T, hidden] in x's dtype."""

    def __init__(self, hidden: int, spec: MoESpec, linear: LinearMethod,
                 experts: ExpertsMethod) -> None:
        super().__init__()
        self.routing = spec.routing
        # Router logits feed a softmax and a top-k: kept in float32 whatever the run's dtype
        # (the loader's cast leaves the router's weight in the model's dtype; the logits are
        # widened before routing).
        self.gate = Linear(hidden, spec.num_experts, spec.router_bias, linear)
        self.experts = Experts(spec.num_experts, hidden, spec.expert_inter, spec.activation,
                               spec.expert_bias, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.routing.choose(self.gate(x).float())
        return self.experts(x, ids, weights)


def put_experts(weights: Weights, layer: int, num_experts: int,
                gate: ExpertPart, up: ExpertPart, down: ExpertPart) -> None:
    """Stores one layer's experts under the names its `Experts` module takes: GGUF blocks of
    all three as one list at `model.layers.N.mlp.experts.weight` (handed to
    `Experts.load_quantized`), floats as `...experts.gate_up` [experts, 2 * inter, hidden]
    and `...experts.down` [experts, hidden, inter]. Each part is all experts' matrix (3-D
    floats, or blocks of experts * rows) or a list of one matrix per expert, as HF stores
    Qwen3-MoE's."""
    parts = [_joined(part, num_experts) for part in (gate, up, down)]
    prefix = f"model.layers.{layer}.mlp.experts"
    if all(isinstance(p, QuantizedWeight) for p in parts):
        weights[prefix + ".weight"] = parts  # type: ignore[assignment]
        return
    g, u, d = (p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts)
    weights[prefix + ".gate_up"] = torch.cat([g.reshape(num_experts, -1, g.shape[-1]),
                                              u.reshape(num_experts, -1, u.shape[-1])], dim=1)
    weights[prefix + ".down"] = d.reshape(num_experts, -1, d.shape[-1])


def _joined(part: ExpertPart, num_experts: int) -> torch.Tensor | QuantizedWeight:
    """One expert matrix of all experts: per-expert pieces stacked (blocks of one type
    concatenated row-wise, floats stacked)."""
    if not isinstance(part, list):
        return part
    if len(part) != num_experts:
        raise ValueError(f"{len(part)} expert matrices for {num_experts} experts")
    if all(isinstance(p, QuantizedWeight) and p.row_order is None
           and p.type_name == part[0].type_name for p in part):
        first = part[0]
        return QuantizedWeight(first.type_name, first.rows * num_experts, first.cols,
                               torch.cat([p.raw for p in part]))  # type: ignore[union-attr]
    return torch.stack([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in part])
