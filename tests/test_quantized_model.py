"""The default model (SmolLM2-135M Q4_1, embedding and tied LM head Q8_0) run on its own
quantized blocks (`quantization="auto"`) against the dequantized reference
(`quantization="none"`, the default): what it holds, what it logs, how closely it agrees."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.layers.linear import Linear
from radixserve.model.decoder_stack import DecoderStack
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.weights import weight_formats

pytestmark = [pytest.mark.model]

SETTINGS = dict(dtype="float32", kv_cache_tokens=4096, show_progress=False)
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "List three uses of a hammer:",
    "Translate to German: good morning, how are you?",
    "The history of computing is a story of abstractions. Early machines were programmed "
    "with switches and cables; later came assembly, then high-level languages.",
]


@pytest.fixture(scope="module")
def quantized(model_path: Path) -> LLM:
    return LLM(str(model_path), quantization="auto", **SETTINGS)


@pytest.fixture(scope="module")
def reference(model_path: Path) -> LLM:
    return LLM(str(model_path), quantization="none", **SETTINGS)


def test_weights_stay_in_the_files_blocks(quantized, model_path):
    # Every projection and the embedding keep the file's formats; the tied LM head shares
    # the embedding's packed table, so memory is the file's tensor bytes, not 2-4 per weight.
    model = quantized.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.weight is None for m in linears)
    assert model.lm_head.packed is model.embed_tokens.packed
    file_bytes = sum(t.n_bytes for t in GGUFFile.open(model_path).tensors.values())
    held = {id(m.packed): m.packed.nbytes for m in linears}
    held[id(model.embed_tokens.packed)] = model.embed_tokens.packed.nbytes
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    total = sum(held.values()) + floats
    assert sum(weight_formats(model).values()) == total  # what the start-up log states
    print(f"weights held: {total / 1e6:.1f} MB for {file_bytes / 1e6:.1f} MB of tensors in "
          f"the file ({total / file_bytes:.3f}x)")
    assert total <= 1.15 * file_bytes


def test_the_path_load_time_and_bytes_are_logged_at_start(model_path, caplog):
    with caplog.at_level(logging.INFO, logger="radixserve.engine"):
        LLM(str(model_path), quantization="auto", **SETTINGS)
    assert "projections: gguf (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) on the " in caplog.text
    assert re.search(r"loaded \S+ in [0-9.]+ s: 9[0-9.]+ MB of weights held \(Q8_0 ", caplog.text)
    with pytest.raises(ValueError, match=r"quantization must be one of \('auto', 'none', "
                                         r"'int8', 'int4'\), got 'int3'"):
        LLM(str(model_path), quantization="int3", **SETTINGS)


def test_greedy_output_agrees_with_the_dequantized_reference(quantized, reference):
    # int8 activations per 32 weights (as llama.cpp multiplies Q4_1/Q8_0) against float32
    # activations. Measured on these prompts: the first token always agrees, the logits
    # differ by 3-13% of their spread (RMS), and greedy text drifts apart after a while.
    # (Chat prompts reach 27%, near-ties between first tokens then flip: see
    # docs/benchmark-log.md, "The default model on its own blocks".)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    agreed, total = 0, 0
    for text in PROMPTS:
        ids = quantized.tokenizer.encode(text)
        want, got = reference.engine.prompt_logits(ids), quantized.engine.prompt_logits(ids)
        assert got.argmax() == want.argmax(), text
        rms = (got - want).pow(2).mean().sqrt() / want.std()
        assert 0 < rms < 0.2, (text, rms)
        a = quantized.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        b = reference.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        agreed, total = agreed + same, total + len(x)
    print(f"greedy tokens identical before the first divergence: {agreed} of {total}")
    assert agreed >= total // 2


@pytest.fixture(scope="module")
def bf16(model_path: Path) -> LLM:
    return LLM(str(model_path), quantization="auto", dtype="bfloat16", kv_cache_tokens=1024,
               show_progress=False)


@pytest.mark.parametrize("which", ["quantized", "bf16", "reference"])
def test_the_decoder_stack_gives_the_python_layers_bits(which, request, monkeypatch):
    # The layers as one C++ call per step (GGUF panels in float32 or bfloat16, or float
    # panels for the reference) run the Python layers' kernels in their order: the same
    # tokens and the same logprobs to the last bit, through decode-only steps and mixed ones
    # (with a small token budget, prompts are prefilled in chunks beside the others' decode
    # rows), and through a step of more rows than the stack's MLP takes at a time (256).
    llm = request.getfixturevalue(which)
    model = llm.engine.model
    if which == "reference" and model.linear_method.name != "float-panels":
        pytest.skip(f"float panels need AVX2 or AVX-512 ({model.linear_method.name} runs "
                    "here, which has no C++ form: the Python layers run)")
    assert model.stack is not None
    ran: list[tuple[bool, bool, int]] = []  # (decode and prefill rows mixed, it ran, rows)
    run = DecoderStack.run

    def counted(self, x, rotary, batch, caches):
        out = run(self, x, rotary, batch, caches)
        plan = batch.attention_plan
        ran.append((plan.decode is not None and plan.prefill is not None, out is not None,
                    x.shape[0]))
        return out

    monkeypatch.setattr(DecoderStack, "run", counted)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    long_prompt = " ".join(PROMPTS * 5)  # about 400 tokens

    def generate(prompts: list[str], budget: int) -> list[tuple[list[int], list]]:
        monkeypatch.setattr(llm.engine.config, "max_num_batched_tokens", budget)
        llm.engine.cache.reset()  # each run computes every prompt token itself
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    stacked = generate(PROMPTS, 24), generate([long_prompt, PROMPTS[0]], 2048)
    assert ran and all(done for _, done, _ in ran) and any(mixed for mixed, _, _ in ran)
    assert max(rows for _, _, rows in ran) > 256
    monkeypatch.setattr(model, "stack", None)
    assert (generate(PROMPTS, 24), generate([long_prompt, PROMPTS[0]], 2048)) == stacked


@pytest.mark.parametrize("which", ["quantized", "reference"])
@pytest.mark.parametrize("stacked", [True, False], ids=["c++ stack", "python layers"])
def test_the_last_layer_runs_only_for_the_rows_read(which, stacked, request, monkeypatch):
    # Rows nobody reads (a prompt's rows before its last, a mid-prompt chunk) stop in the last
    # layer once their K/V is written: hidden_states returns only the rows sampled from or
    # scoring prompt tokens, bit for bit what the whole last layer gives them.
    llm = request.getfixturevalue(which)
    model = llm.engine.model
    if not stacked:
        monkeypatch.setattr(model, "stack", None)
    elif model.stack is None:
        pytest.skip(f"{model.linear_method.name} has no C++ form here: no stack to test")
    hidden_states = model.hidden_states
    steps: list[tuple[int, int]] = []  # (rows in the step, rows returned)

    def checked(batch, caches):
        out = hidden_states(batch, caches)
        whole = hidden_states(dataclasses.replace(batch, output_rows=None), caches)
        rows = batch.output_rows
        assert torch.equal(out, whole if rows is None else whole[rows])
        steps.append((whole.shape[0], out.shape[0]))
        return out

    monkeypatch.setattr(model, "hidden_states", checked)
    monkeypatch.setattr(llm.engine.config, "max_num_batched_tokens", 24)
    # Arrival order, so that the long prompt's middle chunks get steps of their own (ahead of
    # the short prompts, every step would also carry their rows).
    monkeypatch.setattr(llm.engine.config, "short_prefill_tokens", 0)
    llm.engine.cache.reset()
    long_prompt = " ".join(PROMPTS[-1:] * 2)  # about 60 tokens: chunks with no row read
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([long_prompt, PROMPTS[0], PROMPTS[2]], [greedy, scored, greedy],
                        use_tqdm=False)
    assert (0 < len(outs[1].prompt_logprobs or ())
            == len(llm.tokenizer.encode(PROMPTS[0])))  # its prompt rows were all returned
    assert any(returned == 0 for _, returned in steps)  # a chunk that only wrote K/V
    assert any(0 < returned < rows for rows, returned in steps)  # prefill tails, decodes
    assert all(returned <= rows for rows, returned in steps)


def test_bfloat16_activations_run_on_the_same_blocks(bf16, quantized):
    # Where bfloat16 is the compute dtype the kernel takes bfloat16 activations; the
    # quantized arithmetic is the same, so the argmax matches the float32 run.
    ids = quantized.tokenizer.encode(PROMPTS[0])
    got = bf16.engine.prompt_logits(ids)
    assert got.dtype == torch.float32 and bf16.engine.model.lm_head.packed is not None
    assert got.argmax() == quantized.engine.prompt_logits(ids).argmax()
