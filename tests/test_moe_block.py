"""The mixture-of-experts block (radixserve/model/moe.py, radixserve/layers/experts.py) against
transformers' Qwen3MoeSparseMoeBlock and GptOssMLP in float32 with random weights, every
expert hit; and its quantized experts (csrc/gguf/gguf_moe.cpp) against the same block on the
dequantized weights.

Tolerances: float32 block vs transformers 2e-5 of the output's RMS (summation order only).
Quantized experts vs the dequantized reference: the RMS of the difference within 2% of the
output's RMS (measured 1.1-1.6%: the rounding of the int8 activations, x and then the experts'
activations, as for gguf_linear); and each expert is gguf_linear's result for its rows, whatever
the batch (bitwise) or the vector path (bitwise). A wrong normalisation must fail the float
check by far more than its tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.kernels import gguf_ops
from radixserve.layers.experts import (
    ExpertActivation,
    ExpertBlocks,
    FloatExperts,
    QuantizedExperts,
)
from radixserve.layers.linear import DenseLinear
from radixserve.layers.quantized_weight import EXECUTED_TYPES, QuantizedWeight
from radixserve.model.moe import MoEBlock, MoESpec, Routing
from tests.support.quant_blocks import dequantized, random_blocks

transformers = pytest.importorskip("transformers")
OPS = gguf_ops()
HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 256, 256, 8, 2, 48
FLOAT_TOLERANCE = 2e-5


def _rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (ours - reference).abs().max().item() / _rms(reference)


def _qwen3_block(normalize: bool) -> torch.nn.Module:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            norm_topk_prob=normalize)
    block = Qwen3MoeSparseMoeBlock(config).float().eval()
    torch.manual_seed(1)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block


def _ours_from_qwen3(block: torch.nn.Module, spec: MoESpec) -> MoEBlock:
    ours = MoEBlock(HIDDEN, spec, DenseLinear(), FloatExperts())
    ours.gate.weight.data.copy_(block.gate.weight)
    ours.experts.gate_up.data.copy_(block.experts.gate_up_proj)
    ours.experts.down.data.copy_(block.experts.down_proj)
    return ours


def _qwen3_spec(normalize: bool) -> MoESpec:
    return MoESpec(EXPERTS, INTER, Routing("softmax_topk", TOP_K, normalize))


def _tokens(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)) * scale


@torch.inference_mode()
@pytest.mark.parametrize("normalize", [False, True])
def test_the_float_block_matches_qwen3_moe_and_a_wrong_normalisation_does_not(normalize):
    block = _qwen3_block(normalize)
    x = _tokens()
    reference = block(x.unsqueeze(0)).squeeze(0)
    ours = _ours_from_qwen3(block, _qwen3_spec(normalize))
    ids, _ = ours.routing.choose(ours.gate(x))
    assert set(ids.flatten().tolist()) == set(range(EXPERTS))  # every expert hit
    assert _relative(ours(x), reference) < FLOAT_TOLERANCE
    wrong = _ours_from_qwen3(block, _qwen3_spec(not normalize))
    assert _relative(wrong(x), reference) > 100 * FLOAT_TOLERANCE
    softmax_last = _ours_from_qwen3(block, MoESpec(EXPERTS, INTER, Routing("topk_softmax", TOP_K)))
    if not normalize:  # (with normalisation the two rules agree: softmax is monotone)
        assert _relative(softmax_last(x), reference) > 100 * FLOAT_TOLERANCE


def _gpt_oss_mlp() -> torch.nn.Module:
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                          num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    mlp = GptOssMLP(config).float().eval()
    torch.manual_seed(2)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.25)  # gate/up values past the clamp's limit, 7
    return mlp


GPT_OSS_SPEC = MoESpec(EXPERTS, INTER, Routing("topk_softmax", TOP_K),
                       ExpertActivation("clamped_swiglu", 1.702, 7.0), router_bias=True,
                       expert_bias=True)


def _ours_from_gpt_oss(mlp: torch.nn.Module, spec: MoESpec = GPT_OSS_SPEC) -> MoEBlock:
    ours = MoEBlock(HIDDEN, spec, DenseLinear(), FloatExperts())
    ours.gate.weight.data.copy_(mlp.router.weight)
    ours.gate.bias.data.copy_(mlp.router.bias)
    # gpt-oss interleaves gate and up columns ([E, H, 2I], gate at even ones): ours are rows,
    # gate then up.
    w, b = mlp.experts.gate_up_proj.transpose(1, 2), mlp.experts.gate_up_proj_bias
    ours.experts.gate_up.data.copy_(torch.cat([w[:, 0::2], w[:, 1::2]], dim=1))
    ours.experts.gate_up_bias.data.copy_(torch.cat([b[:, 0::2], b[:, 1::2]], dim=1))
    ours.experts.down.data.copy_(mlp.experts.down_proj.transpose(1, 2))
    ours.experts.down_bias.data.copy_(mlp.experts.down_proj_bias)
    return ours


@torch.inference_mode()
def test_the_float_block_matches_gpt_oss_with_its_clamp_and_a_plain_silu_does_not():
    mlp = _gpt_oss_mlp()
    x = _tokens(scale=2.0)
    reference, _ = mlp(x.unsqueeze(0))
    reference = reference.squeeze(0)
    ours = _ours_from_gpt_oss(mlp)
    ids, _ = ours.routing.choose(ours.gate(x))
    assert set(ids.flatten().tolist()) == set(range(EXPERTS))
    gate_up = torch.einsum("th,ekh->tek", x, ours.experts.gate_up)
    assert (gate_up.abs() > 7.0).any()  # the clamp matters
    assert _relative(ours(x), reference) < FLOAT_TOLERANCE
    for wrong in (dataclasses.replace(GPT_OSS_SPEC, activation=ExpertActivation("silu")),
                  dataclasses.replace(GPT_OSS_SPEC, routing=Routing("softmax_topk", TOP_K))):
        assert _relative(_ours_from_gpt_oss(mlp, wrong)(x), reference) > 100 * FLOAT_TOLERANCE


# --- quantized experts -------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(OPS is None, reason="the C++ kernels cannot be built here")


def _blocks(type_names: tuple[str, str, str], seed: int = 0) -> ExpertBlocks:
    shapes = ((EXPERTS * INTER, HIDDEN), (EXPERTS * INTER, HIDDEN), (EXPERTS * HIDDEN, INTER))
    return ExpertBlocks(*(
        QuantizedWeight(name, rows, cols,
                        torch.from_numpy(random_blocks(rows, cols, name, seed + i)))
        for i, (name, (rows, cols)) in enumerate(zip(type_names, shapes, strict=True))))


def _float_twin(blocks: ExpertBlocks, spec: MoESpec, router: torch.Tensor,
                bias: tuple[torch.Tensor, torch.Tensor] | None) -> MoEBlock:
    """The block on gguf-py's decoding of the blocks, run by PyTorch: the reference."""
    ours = MoEBlock(HIDDEN, spec, DenseLinear(), FloatExperts())
    ours.gate.weight.data.copy_(router)
    gate, up, down = (torch.from_numpy(dequantized(b.raw.numpy(), b.type_name))
                      for b in (blocks.gate, blocks.up, blocks.down))
    ours.experts.set_float(gate.view(EXPERTS, INTER, HIDDEN), up.view(EXPERTS, INTER, HIDDEN),
                           down.view(EXPERTS, HIDDEN, INTER))
    if bias is not None:
        ours.experts.gate_up_bias.data.copy_(bias[0])
        ours.experts.down_bias.data.copy_(bias[1])
    return ours


def _quantized(blocks: ExpertBlocks, twin: MoEBlock, spec: MoESpec,
               max_path: int | None = None) -> MoEBlock:
    from radixserve.kernels import PanelArena

    path = OPS.path() if max_path is None else max_path
    ours = MoEBlock(HIDDEN, spec, DenseLinear(), QuantizedExperts(OPS, path, PanelArena()))
    ours.gate.weight.data.copy_(twin.gate.weight)
    if spec.expert_bias:
        ours.experts.gate_up_bias.data.copy_(twin.experts.gate_up_bias)
        ours.experts.down_bias.data.copy_(twin.experts.down_bias)
    ours.experts.load_blocks(blocks)
    return ours


# Each format as gate/up and as down, with the routing and activation of each family.
CASES = [("qwen3_moe", ("Q4_K", "Q4_K", "Q6_K")), ("qwen3_moe", ("Q4_0", "Q6_K", "Q8_0")),
         ("gpt_oss", ("Q8_0", "Q8_0", "Q4_0")), ("gpt_oss", ("Q6_K", "Q4_K", "Q4_K"))]


@needs_kernels
@torch.inference_mode()
@pytest.mark.parametrize(("family", "types"), CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_quantized_experts_agree_with_the_dequantized_block(family, types):
    spec = _qwen3_spec(True) if family == "qwen3_moe" else GPT_OSS_SPEC
    blocks = _blocks(types)
    router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.1
    bias = None
    if spec.expert_bias:
        g = torch.Generator().manual_seed(4)
        bias = (torch.randn(EXPERTS, 2 * INTER, generator=g), torch.randn(EXPERTS, HIDDEN,
                                                                         generator=g) * 0.1)
    twin = _float_twin(blocks, spec, router, bias)
    if spec.router_bias:
        twin.gate.bias.data.zero_()
    quantized = _quantized(blocks, twin, spec)
    if spec.router_bias:
        quantized.gate.bias.data.zero_()
    x = _tokens(scale=3.0)
    reference, ours = twin(x), quantized(x)
    # The int8 activations (x, then the experts' activations) cost 1.1-1.6% here.
    assert _rms(ours - reference) < 0.02 * _rms(reference)
    # Bitwise: each token alone gives its row of the batch, and bfloat16 rounds the same values.
    ids, weights = quantized.routing.choose(quantized.gate(x))
    for t in (0, 17, TOKENS - 1):
        alone = quantized.experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1])
        assert torch.equal(alone, quantized.experts(x, ids, weights)[t:t + 1])
    half = x.bfloat16()
    assert torch.equal(quantized.experts(half, ids, weights),
                       quantized.experts(half.float(), ids, weights).bfloat16())


@needs_kernels
@torch.inference_mode()
def test_quantized_experts_are_each_experts_gguf_linear_on_every_path():
    spec = _qwen3_spec(False)
    blocks = _blocks(("Q4_K", "Q8_0", "Q6_K"), seed=5)
    twin = _float_twin(blocks, spec, torch.randn(EXPERTS, HIDDEN) * 0.1, None)
    x = _tokens(seed=6, scale=3.0)
    ids, weights = twin.routing.choose(twin.gate(x))
    results = []
    for path in range(OPS.path() + 1):
        block = _quantized(blocks, twin, spec, max_path=path)
        results.append(block.experts(x, ids, weights))
        panels = block.experts.panels
    assert all(torch.equal(r, results[0]) for r in results[1:])
    # One token's first choice, by hand from gguf_linear on that expert's panel rows.
    t, e = 5, ids[5, 0].item()
    rows = slice(e * INTER // 16, (e + 1) * INTER // 16)
    gate = OPS.linear(x[t:t + 1], panels.gate[0][rows].contiguous(), panels.gate[1], INTER,
                      None, OPS.path())
    up = OPS.linear(x[t:t + 1], panels.up[0][rows].contiguous(), panels.up[1], INTER, None,
                    OPS.path())
    down_rows = slice(e * HIDDEN // 16, (e + 1) * HIDDEN // 16)
    act = gate * torch.sigmoid(gate) * up
    down = OPS.linear(act, panels.down[0][down_rows].contiguous(), panels.down[1], HIDDEN, None,
                      OPS.path())
    one_hot = torch.zeros_like(weights[t:t + 1])
    one_hot[0, 0] = 1.0
    alone = block.experts(x[t:t + 1], ids[t:t + 1], one_hot)
    # The activation's exp may differ from PyTorch's in the last bit; the rest is gguf_linear's.
    assert (alone - down).abs().max().item() < 1e-5 * _rms(down)


@needs_kernels
@torch.inference_mode()
def test_one_token_reads_only_its_experts_bytes():
    spec = _qwen3_spec(False)
    blocks = _blocks(("Q4_K", "Q4_K", "Q6_K"))
    block = _quantized(blocks, _float_twin(blocks, spec, torch.zeros(EXPERTS, HIDDEN), None),
                       spec)
    panels = block.experts.panels
    per_expert = sum(p.numel() for p, _ in (panels.gate, panels.up, panels.down)) // EXPERTS
    assert block.experts.active_bytes(TOP_K) == TOP_K * per_expert
    file_bytes = sum(b.raw.numel() for b in (blocks.gate, blocks.up, blocks.down))
    assert panels.nbytes <= 1.03 * file_bytes
    assert set(EXECUTED_TYPES) >= {"Q4_K", "Q6_K", "Q8_0", "Q4_0"}


@needs_kernels
@torch.inference_mode()
def test_bad_routing_input_is_refused_with_a_clear_error():
    spec = _qwen3_spec(False)
    blocks = _blocks(("Q8_0", "Q8_0", "Q8_0"))
    block = _quantized(blocks, _float_twin(blocks, spec, torch.zeros(EXPERTS, HIDDEN), None),
                       spec)
    x = _tokens()[:2]
    with pytest.raises(ValueError, match="expert id 8 is not one of 8 experts"):
        block.experts(x, torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="weights: contiguous float32"):
        OPS.moe(x[:1], torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.float64),
                block.experts.panels.gate,
                block.experts.panels.up, block.experts.panels.down, EXPERTS, INTER, None, None,
                0, 1.0, 1.0, 0)
