"""The float matmul (radixserve/kernels/csrc/float_panels/) and its linear method, PanelFloatLinear.

The kernel against a float64 product of the weights as held (bfloat16, float16 or float32),
within the proven bound of a float32 FMA chain, for every row count its tiles special-case,
odd shapes and with or without bias; its vector paths equal the portable one bit for bit, and
a row's result does not depend on the batch or thread count. The method keeps each weight at
the narrowest width that loses nothing, and the engine runs BF16/F16 files at 2 bytes per
parameter with HF's logits.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.kernels import PanelArena, float_panel_ops, path_names
from radixserve.kernels.cpu import cpu_flags, has_fast_bf16
from radixserve.layers.linear import (
    Linear,
    PanelEmbedding,
    PanelFloatLinear,
    choose_linear_method,
)

pytestmark = [pytest.mark.model]

OPS = float_panel_ops()
BEST = OPS.path() if OPS else 0  # this CPU's path
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# 1-3: one tile of all rows over several panels; 4-6: one tile; then tiles as even as can be
# of at most 6 rows (AVX2: 7 = 4 + 3, 13 = 5 + 4 + 4) or 12 (AVX-512: 13 = 7 + 6, 25 = 9 + 8 + 8).
ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 17, 25, 48, 100]
# (N, K): N and K odd (a partial last panel), one input feature, the default model's qkv.
SHAPES = [(37, 33), (16, 1), (200, 97), (960, 576)]


def _paths() -> list:
    return [pytest.param(path, id=name, marks=pytest.mark.skipif(
        path > BEST, reason=f"this CPU runs the {path_names('float_panels')[BEST]} path: {name} is checked "
        "natively on machines that have it (avx512 also on an emulated CPU in "
        "test_emulated_avx512.py)")) for path, name in enumerate(path_names("float_panels"))]


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)


def _linear(x, weight, bias=None, path=BEST):
    return OPS.linear(x, OPS.pack(weight, weight.dtype), weight.shape[0], bias, path)


def test_the_library_builds_and_names_the_path_of_this_cpu():
    assert OPS is not None  # part of the engine on this project's machines
    flags = cpu_flags()
    expected = "portable"
    if "avx512f" in flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    assert OPS.path_name() == expected and OPS.path_name(0) == "portable"


def test_pack_puts_16_rows_k_major_and_pads_with_zeros():
    weight = torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5)
    panels = OPS.pack(weight, torch.bfloat16)
    assert panels.shape == (3, 5, 16) and panels.dtype == torch.bfloat16
    assert torch.equal(panels[1, :, 3].float(), weight[19])
    assert torch.equal(panels[2, :, 5:], torch.zeros(5, 11, dtype=torch.bfloat16))
    # Panels of 4 MB or more start on a 2 MB boundary, where huge pages can hold them
    # (test_gguf_kernels.py checks the pages themselves).
    big = torch.randn(1040, 2048)
    panels = OPS.pack(big, torch.bfloat16)
    assert panels.data_ptr() % (2 << 20) == 0 or sys.platform != "linux"
    assert torch.equal(panels[64, :, 15], big[64 * 16 + 15].to(torch.bfloat16))
    # Through an arena (as PanelFloatLinear packs a model), small weights lie side by side.
    arena = PanelArena()
    first, second = OPS.pack(weight, torch.float16, arena), OPS.pack(weight, torch.float32, arena)
    assert torch.equal(first, OPS.pack(weight, torch.float16))
    assert torch.equal(second, OPS.pack(weight, torch.float32))
    assert first.data_ptr() % (2 << 20) == 0 or sys.platform != "linux"
    assert second.data_ptr() == first.data_ptr() + 3 * 5 * 16 * 2 + 32  # 480 bytes, to 512


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_linear_matches_float64(dtype, shape, bias, path):
    n, k = shape
    weight = _weights(n, k, dtype, seed=n + k)
    b = torch.randn(n) if bias else None
    gen = torch.Generator().manual_seed(k)
    for m in ROW_COUNTS if path else [1, 2, 3, 7, 13]:  # the portable path is slow
        x = torch.randn(m, k, generator=gen)
        got = _linear(x, weight, b, path)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        exact = x.double() @ weight.double().t()
        # A chain of k float32 FMAs errs by at most k * 2^-24 * sum |x w|; the bias adds one
        # rounding of the result.
        bound = k * 2.0**-24 * (x.double().abs() @ weight.double().abs().t())
        if bias:
            exact += b.double()
        bound += 2.0**-24 * exact.abs() + 1e-30
        assert ((got.double() - exact).abs() <= bound).all(), m


@pytest.mark.parametrize("path", _paths()[1:])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_vector_paths_equal_the_portable_path_bitwise(dtype, path):
    n, k = 53, 70
    weight = _weights(n, k, dtype, seed=1)
    b = torch.randn(n)
    for m in ROW_COUNTS:
        x = torch.randn(m, k)
        assert torch.equal(_linear(x, weight, b, path), _linear(x, weight, b, 0)), m


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rows_are_batch_invariant(dtype):
    # A row's output is the same bits alone, in any sub-batch and whatever the thread count:
    # what makes the prefix cache's on == off exact through the projections.
    weight = _weights(300, 200, dtype, seed=2)
    x = torch.randn(300, 200)
    full = _linear(x, weight)
    for lo, hi in [(0, 1), (5, 6), (7, 9), (10, 13), (3, 70), (250, 300), (299, 300)]:
        assert torch.equal(_linear(x[lo:hi], weight), full[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_linear(x, weight), full)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_refused():
    weight = _weights(40, 64, torch.bfloat16)
    panels = OPS.pack(weight, torch.bfloat16)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="float32 x"):
        OPS.linear(x.double(), panels, 40, None, BEST)
    with pytest.raises(RuntimeError, match="contiguous x"):
        OPS.linear(torch.randn(64, 3).t(), panels, 40, None, BEST)
    with pytest.raises(RuntimeError, match="K = 64 for x of K = 48"):
        OPS.linear(torch.randn(3, 48), panels, 40, None, BEST)
    with pytest.raises(RuntimeError, match="3 panels cannot hold N = 49"):
        OPS.linear(x, panels, 49, None, BEST)
    with pytest.raises(RuntimeError, match="3 panels cannot hold N = 32"):
        OPS.linear(x, panels, 32, None, BEST)
    with pytest.raises(RuntimeError, match="bias"):
        OPS.linear(x, panels, 40, torch.randn(39), BEST)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16 panels"):
        OPS.linear(x, panels.double(), 40, None, BEST)
    with pytest.raises(RuntimeError, match="contiguous panels"):
        OPS.linear(x, panels.transpose(0, 1), 40, None, BEST)
    assert OPS.linear(torch.empty(0, 64), panels, 40, None, BEST).shape == (0, 40)


# ----- the linear method -----


def _layer(weight: torch.Tensor, bias: bool, method: PanelFloatLinear) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias, method)
    layer.weight = torch.nn.Parameter(weight.clone())
    if bias:
        torch.nn.init.normal_(layer.bias)
    method.prepare(layer)
    return layer


def test_method_keeps_each_weight_at_the_narrowest_exact_width():
    # A BF16 file's values (widened to float32 at load) are held as bfloat16, an F16 file's as
    # float16, both exactly; values neither holds keep float32.
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(40, 64, generator=gen)
    method = PanelFloatLinear()
    cases = {torch.bfloat16: values.bfloat16().float(), torch.float16: values.half().float(),
             torch.float32: values}
    for held, weight in cases.items():
        layer = _layer(weight, True, method)
        assert layer.weight is None and layer.panels.dtype == held
        assert torch.equal(layer.panels.float().transpose(1, 2).reshape(48, 64)[:40], weight)
        x = torch.randn(5, 64)
        exact = x.double() @ weight.double().t() + layer.bias.double()
        assert (layer(x).double() - exact).abs().max() < 1e-4
    assert method.describe() == (f"float-panels on the {OPS.path_name()} path (weights: "
                                 "1 bfloat16, 1 float16, 1 float32)")


def test_a_tied_table_reads_its_rows_from_the_head_panels():
    table = _weights(37, 24, torch.bfloat16).float()
    head = _layer(table, False, PanelFloatLinear())
    embedding = PanelEmbedding(head, torch.float32)
    assert embedding.panels is head.panels and embedding.num_embeddings == 37
    ids = torch.tensor([[0, 15, 16], [36, 17, 5]])
    assert torch.equal(embedding(ids), table[ids])
    with pytest.raises(ValueError, match="no panels"):
        PanelEmbedding(Linear(24, 37, False, PanelFloatLinear()), torch.float32)


def test_method_takes_half_precision_inputs_and_rounds_once():
    weight = _weights(48, 64, torch.bfloat16).float()
    layer = _layer(weight, True, PanelFloatLinear())
    x = torch.randn(9, 2, 64).bfloat16()  # any leading shape
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (9, 2, 48)
    wide = OPS.linear(x.reshape(18, 64).float(), layer.panels, 48, layer.bias, BEST)
    assert torch.equal(out, wide.reshape(9, 2, 48).bfloat16())


def test_method_refuses_an_unprepared_layer_and_what_it_cannot_run():
    layer = Linear(64, 32, False, PanelFloatLinear())
    with pytest.raises(RuntimeError, match="prepare"):
        layer(torch.randn(2, 64))
    cpu = torch.device("cpu")
    assert "float dtype" in PanelFloatLinear.unavailable(torch.device("meta"), torch.float32)
    assert "float dtype" in PanelFloatLinear.unavailable(cpu, torch.int8)


def test_auto_picks_it_where_bfloat16_dot_products_are_missing():
    cpu = torch.device("cpu")
    has_path = BEST > 0
    assert (PanelFloatLinear.unavailable(cpu, torch.float32) is None) == has_path
    assert choose_linear_method("auto", cpu, torch.float32).name == (
        "float-panels" if has_path else "torch")
    if not has_fast_bf16():  # AVX512-BF16 machines run bfloat16 on the bfloat16 kernel
        assert choose_linear_method("auto", cpu, torch.bfloat16).name == (
            "float-panels" if has_path else "widen")
    assert choose_linear_method("float-panels", cpu, torch.float32).max_path == BEST


# ----- the engine -----

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_engine_holds_a_half_precision_file_at_two_bytes_per_parameter(dtype, tmp_path,
                                                                       model_path):
    # A random Llama saved as BF16 / F16 safetensors: the float32 engine (AVX2 machines' auto)
    # holds every projection at 16 bits, exactly, and its logits and greedy tokens match HF's
    # float32 run of the same values.
    from radixserve.model.loader import load_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=49152, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).to(dtype)
    directory = tmp_path / "model"
    hf.save_pretrained(directory, safe_serialization=True)
    tokenizer = load_tokenizer(model_path)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "eos_token": tokenizer.eos_token}))
    hf = hf.float().eval()
    llm = LLM(str(directory), dtype="float32", matmul_backend="auto", kv_cache_tokens=2048,
              quantization="none", show_progress=False)
    model = llm.engine.model
    if model.linear_method.name != "float-panels":
        pytest.skip(f"auto runs {model.linear_method.name} on this CPU")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 + 1 and all(m.panels.dtype == dtype for m in linears)
    parameters = sum(m.in_features * m.out_features for m in linears)
    assert sum(m.panels.nbytes for m in linears) == 2 * parameters  # no row padding here
    name = str(dtype).removeprefix("torch.")
    assert f"weights: {len(linears)} {name}" in model.linear_method.describe()
    ids = torch.randint(200, 40000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    got = llm.engine.prompt_logits(ids)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 40, dtype=torch.long),
                      max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 40:].tolist()
    ours = llm.generate({"prompt_token_ids": ids},
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == ref


def test_engine_default_model_agrees_with_onednn(model_path):
    # The default model (Q4_1 blocks dequantized to float32: values 16 bits would round, so
    # float32 panels) gives nn.Linear's greedy tokens and logits within float32 reordering.
    settings = dict(dtype="float32", kv_cache_tokens=2048, show_progress=False,
                    quantization="none")
    ours = LLM(str(model_path), matmul_backend="auto", **settings)
    if ours.engine.model.linear_method.name != "float-panels":
        pytest.skip(f"auto runs {ours.engine.model.linear_method.name} on this CPU")
    onednn = LLM(str(model_path), matmul_backend="torch", **settings)
    layers = ours.engine.model_config.num_layers
    assert f"weights: {4 * layers + 1} float32" in ours.engine.model.linear_method.describe()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for text in ["The capital of France is", "Write a haiku about the sea."]:
        ids = ours.tokenizer.encode(text)
        a, b = ours.engine.prompt_logits(ids), onednn.engine.prompt_logits(ids)
        assert (a - b).abs().max() < 1e-3
        prompt = {"prompt_token_ids": ids}
        assert (ours.generate(prompt, greedy)[0].outputs[0].token_ids
                == onednn.generate(prompt, greedy)[0].outputs[0].token_ids)


def test_the_former_name_skinny_float_still_selects_float_panels():
    # Commands written before the rename keep working: the old value maps to the new one.
    assert EngineConfig(matmul_backend="skinny-float").matmul_backend == "float-panels"
    assert EngineConfig(matmul_backend="float-panels").matmul_backend == "float-panels"
