"""A mixture-of-experts layer's experts (`Experts`: every expert's gate, up and down
projections, with an optional bias each) and the methods that run them for tokens the router
has already assigned: `FloatExperts` (PyTorch, any device) and `QuantizedExperts` (the GGUF
kernel, csrc/gguf/gguf_moe.cpp, over the file's blocks: one C++ call per layer that reads only
the chosen experts' weights, once per step). The model's MoE block (radixserve/model/moe.py)
routes; this module only computes.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import GGUFOps, PanelArena
from radixserve.layers.linear import LinearMethod
from radixserve.layers.quantized import QuantizedLinear
from radixserve.layers.quantized_weight import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert combines its gate and up projections: "silu" is silu(gate) * up
    (Qwen3-MoE, Mixtral); "clamped_swiglu" is gpt-oss's (clamp(up, -limit, limit) + 1) *
    g * sigmoid(alpha * g) with g = min(gate, limit)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    KINDS: ClassVar[tuple[str, ...]] = ("silu", "clamped_swiglu")  # the kernel's codes, in order

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"expert activation {self.kind!r} is not one of {self.KINDS}")

    @property
    def code(self) -> int:
        return self.KINDS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class ExpertBlocks:
    """Every expert's projections in GGUF blocks, as the loader hands them over: gate and up
    [experts * inter, hidden] and down [experts * hidden, inter], expert e's rows a
    contiguous run (llama.cpp's ffn_{gate,up,down}_exps)."""

    gate: QuantizedWeight
    up: QuantizedWeight
    down: QuantizedWeight


@dataclass(frozen=True)
class ExpertPanels:
    """ExpertBlocks packed for the kernel: (panels, GGUF type) per projection."""

    gate: tuple[torch.Tensor, int]
    up: tuple[torch.Tensor, int]
    down: tuple[torch.Tensor, int]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p, _ in (self.gate, self.up, self.down))


class ExpertsMethod(ABC):
    """How a layer's experts run; chosen once per engine (`experts_method`)."""

    name: ClassVar[str]

    def describe(self) -> str:
        return self.name

    def take_blocks(self, experts: Experts, blocks: ExpertBlocks) -> None:
        """Takes the file's blocks in place of float weights (decoded to float here, where
        this method runs floats)."""
        experts.set_float(*(b.dequantize().view(experts.num_experts, -1, b.cols)
                            for b in (blocks.gate, blocks.up, blocks.down)))

    @abstractmethod
    def apply(self, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: sum over j of weights[t, j] times expert ids[t, j]'s
        output for token t."""


class FloatExperts(ExpertsMethod):
    """PyTorch matmuls on float weights, the tokens grouped by expert so that each chosen
    expert's weights are read once per call."""

    name = "torch"

    def apply(self, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        if experts.gate_up is None or experts.down is None:
            raise RuntimeError("experts: no float weights loaded")
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
        tokens = order // top_k
        chosen = weights.reshape(-1)[order].float().unsqueeze(1)
        out = torch.zeros(x.shape[0], experts.hidden, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            gate_up = F.linear(x[rows], experts.gate_up[e],
                               None if experts.gate_up_bias is None else experts.gate_up_bias[e])
            gate, up = gate_up.split(experts.inter, dim=-1)
            y = F.linear(experts.activation(gate, up), experts.down[e],
                         None if experts.down_bias is None else experts.down_bias[e])
            out.index_add_(0, rows, y.float() * chosen[start:start + n])
            start += n
        return out.to(x.dtype)


class QuantizedExperts(ExpertsMethod):
    """The experts kept in the file's GGUF blocks, repacked once into the kernel's panels
    (about the file's bytes) and run by one C++ call per layer (csrc/gguf/gguf_moe.cpp):
    activations quantized per block as for gguf_linear, each chosen expert's panels streamed
    once for all its tokens, so at one token per step the bytes read are the active experts'
    only. Experts loaded as floats run on `FloatExperts`."""

    name = "gguf"

    def __init__(self, ops: GGUFOps, max_path: int, arena: PanelArena) -> None:
        self.ops, self.max_path, self.arena = ops, max_path, arena
        self.floats = FloatExperts()

    def describe(self) -> str:
        return f"gguf experts on the {self.ops.path_name(self.max_path)} path"

    def take_blocks(self, experts: Experts, blocks: ExpertBlocks) -> None:
        if experts.inter % 16 or experts.hidden % 16:  # an expert's rows fill whole panels
            log.info("experts of %d -> %d -> %d are not whole 16-row panels: run as floats",
                     experts.hidden, experts.inter, experts.hidden)
            super().take_blocks(experts, blocks)
            return
        experts.panels = ExpertPanels(*((b.pack(self.ops, self.arena), b.type_id)
                                        for b in (blocks.gate, blocks.up, blocks.down)))
        experts.gate_up = experts.down = None

    def apply(self, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        panels = experts.panels
        if panels is None:
            return self.floats.apply(experts, x, ids, weights)
        act = experts.activation
        gate_up_bias, down_bias = experts.float_biases()
        return self.ops.moe(x.contiguous(), ids.contiguous(), weights.float().contiguous(),
                            panels.gate, panels.up, panels.down, experts.num_experts,
                            experts.inter, gate_up_bias, down_bias, act.code, act.alpha,
                            act.limit, self.max_path)


def experts_method(linear: LinearMethod) -> ExpertsMethod:
    """The experts' method beside a model's linear method: the GGUF kernel where projections
    run quantized (same path cap, same arena), PyTorch otherwise."""
    if isinstance(linear, QuantizedLinear):
        return QuantizedExperts(linear.ops, linear.max_path, linear.arena)
    return FloatExperts()


class Experts(nn.Module):
    """`num_experts` gated MLPs of hidden -> inter -> hidden. Float weights: gate_up
    [experts, 2 * inter, hidden] (gate rows, then up rows) and down [experts, hidden, inter];
    quantized ones: `panels`, set by the method from the file's blocks (`load_blocks`).
    Biases, where the family has them, stay float: gate_up_bias [experts, 2 * inter],
    down_bias [experts, hidden]."""

    def __init__(self, num_experts: int, hidden: int, inter: int, activation: ExpertActivation,
                 bias: bool, method: ExpertsMethod) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.activation, self.method = activation, method
        self.gate_up: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, 2 * inter,
                                                                     hidden))
        self.down: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_bias: nn.Parameter | None
        self.down_bias: nn.Parameter | None
        self.register_parameter("gate_up_bias", nn.Parameter(torch.empty(num_experts, 2 * inter))
                                if bias else None)
        self.register_parameter("down_bias", nn.Parameter(torch.empty(num_experts, hidden))
                                if bias else None)
        self.panels: ExpertPanels | None = None
        self._float_biases: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def load_quantized(self, parts: list[QuantizedWeight]) -> None:
        """Takes the file's blocks of gate, up and down (in that order), as the model's
        weight loader hands a module its quantized parts."""
        if len(parts) != 3:
            raise ValueError(f"experts take 3 quantized parts (gate, up, down), not {len(parts)}")
        self.load_blocks(ExpertBlocks(*parts))

    def load_blocks(self, blocks: ExpertBlocks) -> None:
        """Takes the file's blocks for the three projections in place of float weights."""
        e, h, i = self.num_experts, self.hidden, self.inter
        for name, weight, shape in (("gate", blocks.gate, (e * i, h)), ("up", blocks.up, (e * i, h)),
                                    ("down", blocks.down, (e * h, i))):
            if (weight.rows, weight.cols) != shape:
                raise ValueError(f"expert {name} blocks of {weight.rows}x{weight.cols} do not fit "
                                 f"{e} experts of {h} -> {i} -> {h} ({shape[0]}x{shape[1]})")
        self.method.take_blocks(self, blocks)

    def set_float(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Float weights: gate and up [experts, inter, hidden], down [experts, hidden, inter]."""
        self.gate_up = nn.Parameter(torch.cat([gate, up], dim=1), requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)

    def float_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The biases in float32, as the kernel takes them: made on the first step (they
        are loaded after the blocks, and cast with the model), then kept."""
        if self._float_biases is None:
            self._float_biases = tuple(  # type: ignore[assignment]
                None if b is None else b.detach().float().contiguous()
                for b in (self.gate_up_bias, self.down_bias))
        assert self._float_biases is not None
        return self._float_biases

    def active_bytes(self, top_k: int) -> int:
        """Bytes of weights one token's `top_k` experts read (the panels where quantized)."""
        if self.panels is not None:
            return self.panels.nbytes * top_k // self.num_experts
        assert self.gate_up is not None and self.down is not None
        return (self.gate_up[0].nbytes + self.down[0].nbytes) * top_k

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, ids, weights)
