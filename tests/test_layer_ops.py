"""The fused layer ops (radixserve/kernels/csrc/layer_ops/layer_ops.cpp) against the PyTorch ops they
replace, and the model's use of them."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import layer_ops
from radixserve.model.blocks import RMSNorm
from radixserve.model.forward_batch import Rotary

ops = layer_ops()
pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(ops is None, reason="the C++ kernels cannot be built here"),
]


def _reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm in float64, rounded as HF rounds: to x's dtype, then times the weight.
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    return w * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 2048), (17, 100), (300, 64)])
def test_rms_norm_matches_hf(dtype, rows, hidden):
    torch.manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    w = torch.randn(hidden).to(dtype)
    got = ops.rms_norm(x, w, 1e-5)
    want = _reference_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # one bfloat16 step away at most, from the rounding of the normalised value
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()
    # A row's result does not depend on the rows around it (a decode row vs a prefill step).
    assert torch.equal(ops.rms_norm(x[-1:].contiguous(), w, 1e-5), got[-1:])


def test_rms_norm_module_uses_the_op_and_agrees_with_pytorch():
    torch.manual_seed(0)
    fused, plain = RMSNorm(256, 1e-6, ops), RMSNorm(256, 1e-6)
    with torch.no_grad():
        fused.weight.copy_(torch.randn(256))
        plain.weight.copy_(fused.weight)
    x = torch.randn(5, 256)
    assert torch.allclose(fused(x), plain(x), rtol=1e-5, atol=1e-6)
    # A wrong epsilon or a missing weight would be caught:
    assert not torch.allclose(ops.rms_norm(x, fused.weight.detach(), 1.0), plain(x), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (33, 100)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, rows, hidden):
    torch.manual_seed(rows + hidden)
    x, d = (torch.randn(rows, hidden) * 3).to(dtype), torch.randn(rows, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    total, normed = ops.add_rms_norm(x, d, w, 1e-5)
    # The sum rounded as PyTorch's add rounds it, and the norm's bits of that sum.
    assert torch.equal(total, x + d)
    assert torch.equal(normed, ops.rms_norm(x + d, w, 1e-5))
    assert total.data_ptr() != x.data_ptr()  # the residual it was given is left as it was
    # The module: the fused call where it runs, PyTorch's add and norm elsewhere, the same sum.
    fused, plain = RMSNorm(hidden, 1e-5, ops), RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        fused.weight.copy_(w)
        plain.weight.copy_(w)
    fused, plain = fused.to(dtype), plain.to(dtype)
    (fused_total, fused_norm), (plain_total, plain_norm) = (
        fused.add_and_norm(x, d), plain.add_and_norm(x, d))
    assert torch.equal(fused_total, plain_total)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fused_norm.float(), plain_norm.float(), rtol=tolerance, atol=tolerance)
    # No delta: the residual as it is, and its norm.
    same, norm_only = fused.add_and_norm(x, None)
    assert same is x and torch.equal(norm_only, ops.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,intermediate", [(1, 8192), (5, 1536), (3, 40)])
def test_silu_mul_is_pytorchs_silu_times_up(dtype, rows, intermediate):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * intermediate) * 4).to(dtype)
    got = ops.silu_mul(gate_up)
    gate, up = gate_up.split(intermediate, dim=-1)
    assert got.shape == (rows, intermediate) and got.is_contiguous()
    assert torch.equal(got, torch.nn.functional.silu(gate) * up)
    # Gate and up the other way round would not pass for it.
    assert not torch.equal(got, torch.nn.functional.silu(up) * gate)


def test_silu_mul_rows_have_the_same_bits_in_any_batch_and_thread_count():
    # PyTorch's silu rounds some values differently in its vector and scalar code; split by
    # elements, a row cut between threads would take the scalar code in the middle and its
    # bits would depend on the batch (cache on == off needs them not to).
    torch.manual_seed(3)
    gate_up = torch.randn(301, 2 * 1536) * 4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ops.silu_mul(gate_up[r:r + 1]) for r in range(gate_up.shape[0])])
        for count in (2, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(ops.silu_mul(gate_up), alone), count
            assert torch.equal(ops.silu_mul(gate_up[7:264]), alone[7:264]), count
            with torch.inference_mode():  # as the engine runs it, on every thread
                assert torch.equal(ops.silu_mul(gate_up), alone), count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_pytorch_rotation(dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 500, 9000])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.double().unsqueeze(-1) * inv_freq.float()
    rotary = Rotary(angles.float().cos(), angles.float().sin())
    want = rotary.rotate(qkv[:, : heads + kv_heads])
    got = qkv.clone()
    ops.rotary_embedding_(got, rotary.cos, rotary.sin, heads + kv_heads)
    if dtype == torch.float32:  # the same products and sums as PyTorch's, in the same order
        assert torch.equal(got[:, : heads + kv_heads], want)
    else:  # cos and sin kept in float32 and one rounding instead of three
        assert torch.allclose(got[:, : heads + kv_heads].float(), want.float(), atol=0.05)
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])  # v untouched
    # Position 0 is the identity; a swapped sin sign would not be.
    assert torch.equal(got[0], qkv[0])
    wrong = qkv.clone()
    ops.rotary_embedding_(wrong, rotary.cos, -rotary.sin, heads + kv_heads)
    assert not torch.allclose(wrong[3:].float(), got[3:].float(), atol=1e-2)


def test_ops_refuse_what_they_cannot_compute():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.rms_norm(x.half(), torch.randn(64).half(), 1e-5)
    qkv = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match="cos and sin"):
        ops.rotary_embedding_(qkv, torch.randn(3, 64), torch.randn(3, 64), 2)
    with pytest.raises(ValueError, match="heads"):
        ops.rotary_embedding_(qkv, torch.randn(3, 32), torch.randn(3, 32), 5)
    with pytest.raises(ValueError, match="x's shape"):
        ops.add_rms_norm(x, torch.randn(2, 32), torch.randn(64), 1e-5)
    with pytest.raises(ValueError, match="gate first"):
        ops.silu_mul(torch.randn(2, 63))


def test_fused_and_pytorch_model_paths_agree(model_path):
    # The default model with and without the fused ops: the same greedy tokens, logits within
    # float32 reordering (the norm's sum runs in another order).
    from radixserve import LLM, SamplingParams

    settings = dict(dtype="float32", kv_cache_tokens=1024, show_progress=False,
                    quantization="none", prefix_cache="off")  # every step computed afresh
    llm = LLM(str(model_path), **settings)
    model = llm.engine.model
    assert model.norm.ops is ops and model.layers[0].self_attn.ops is ops
    assert model.layers[0].mlp.ops is ops
    ids = llm.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fused_logits = llm.engine.prompt_logits(ids)
    fused_tokens = llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids
    for module in model.modules():
        if hasattr(module, "ops") and module.ops is ops:
            module.ops = None
    plain_logits = llm.engine.prompt_logits(ids)
    assert (fused_logits - plain_logits).abs().max() < 1e-3
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == fused_tokens


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 49157])
def test_argmax_rows_is_torchs_argmax(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab)
    if vocab > 8:
        logits[1, 3] = logits[1, vocab - 2] = 50.0  # a tie: the first index wins
        logits[2] = float("-inf")  # nothing finite: index 0, as torch
        logits[3, vocab // 2] = float("nan")  # a NaN wins over any number, as in torch
        logits[3, vocab - 1] = float("nan")
        logits[4, vocab - 1] = float("inf")
        logits[5, :] = 1.0  # all equal
    got = torch.ops.radixserve.argmax_rows(logits)
    assert got.tolist() == torch.argmax(logits, dim=-1).tolist()


def test_write_kv_stores_rows_where_index_copy_would():
    torch.manual_seed(0)
    heads, kv_heads, d, capacity = 4, 2, 64, 40
    qkv = torch.randn(5, heads + 2 * kv_heads, d)  # k and v read in place, strided
    k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    slots = torch.tensor([7, 0, 39, 12, 13])
    got_k, got_v = torch.randn(kv_heads, capacity, d), torch.randn(kv_heads, capacity, d)
    want_k, want_v = got_k.clone(), got_v.clone()
    torch.ops.radixserve.write_kv_(got_k, got_v, slots, k, v)
    want_k.index_copy_(1, slots, k.transpose(0, 1))
    want_v.index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(IndexError, match="outside the pool"):
        torch.ops.radixserve.write_kv_(got_k, got_v, torch.tensor([0, 1, 2, 3, 40]), k, v)
    with pytest.raises(ValueError, match="caches' dtype"):
        torch.ops.radixserve.write_kv_(got_k, got_v, slots, k.double(), v.double())
