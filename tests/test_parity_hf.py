"""Our forward pass against HF transformers on the same GGUF weights, in float32."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import LLM, SamplingParams
from tests.support.engine import SMALL_ENGINE

pytestmark = [pytest.mark.model]

pytest.importorskip("transformers")

PROMPT_LENGTHS = [5, 17, 64, 130, 257, 500, 777, 1000]
# Float32 throughout; the only differences are summation orders (fused qkv, SDPA vs einsum).
LOGIT_TOLERANCE = 2e-3
# Greedy tokens per prompt: each one a full decode step through our stack, enough for a wrong
# KV entry to change the argmax.
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def llm(model_path):
    # The reference path: every GGUF tensor dequantized, as transformers does.
    return LLM(str(model_path), dtype="float32", quantization="none", **SMALL_ENGINE)


def _prompts(llm: LLM) -> list[list[int]]:
    # Natural-ish text so greedy decoding does not sit on near-ties between logits.
    text = (
        "The history of computing is a story of abstractions. Early machines were programmed "
        "with switches and cables; later came assembly, then high-level languages, operating "
        "systems, networks and the web. Each layer hid the one below it. "
    )
    rng = random.Random(7)
    base = llm.tokenizer.encode(text * 40)
    prompts = []
    for n in PROMPT_LENGTHS:
        start = rng.randrange(0, len(base) - n)
        prompts.append(base[start : start + n])
    return prompts


def test_greedy_generation_matches_hf(llm, hf_model):
    prompts = _prompts(llm)
    ours = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True),
    )
    for prompt, result in zip(prompts, ours, strict=True):
        tokens = result.outputs[0].token_ids
        assert len(tokens) == GREEDY_TOKENS
        # HF's greedy choice after the prompt and after each of our tokens, from one forward
        # pass: it equals our token at every step exactly when HF's own greedy generation
        # (which feeds back its choices) would produce our tokens, by induction over the
        # steps. One pass instead of HF's 16 decode steps (80 ms each here).
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        reference = logits.argmax(dim=-1).tolist()
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True))
                         if a != b), None)
        assert diverged is None, f"prompt of {len(prompt)} tokens diverged at token {diverged}"


def test_prefill_logits_match_hf(llm, hf_model):
    for prompt in _prompts(llm)[:4]:
        with torch.inference_mode():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1].float()
        ours = llm.engine.prompt_logits(prompt)
        assert torch.allclose(ours, ref, atol=LOGIT_TOLERANCE, rtol=0), (
            f"max diff {(ours - ref).abs().max():.2e} for {len(prompt)} tokens"
        )
    assert llm.pool_stats().private == 0


# bfloat16 against float32 (ours): measured up to 0.6 (benchmarks/bench_bf16_agreement.py), logits
# of 10-30.
BF16_LOGIT_TOLERANCE = 1.0


def test_bfloat16_prefill_stays_close_to_float32(llm, model_path, monkeypatch):
    # bfloat16 prefill, whole and chunked (a chunk attends to the cached context before it),
    # stays close to float32. It runs the matmul prefill attention this CPU would take without
    # the attention kernel (which is checked against float64 in test_paged_attention): our
    # blocked causal attention where bfloat16 is native (AVX512-BF16/AMX), SDPA where it is
    # emulated (AVX2); the blocked arithmetic itself is checked on every machine in
    # test_attention_paths.
    from radixserve.kernels.cpu import has_fast_bf16
    from radixserve.layers.attention.blocked_prefill import BlockedPrefill
    from radixserve.layers.attention.sdpa_prefill import SdpaPrefill

    backend = BlockedPrefill if has_fast_bf16() else SdpaPrefill
    calls = []
    original = backend.attend

    def counted(self, q, keys, values, span, scale):
        calls.append(span.plain_causal_from)
        return original(self, q, keys, values, span, scale)

    monkeypatch.setattr(backend, "attend", counted)
    whole = LLM(str(model_path), dtype="bfloat16", prefill_attention_backend=backend.name,
                quantization="none", **SMALL_ENGINE)
    assert type(whole.engine.runner.attention.prefill) is backend
    print(f"bfloat16 prefill runs {backend.name}, projections {whole.engine.model.linear_method.name}")
    for prompt in _prompts(llm)[::2]:  # 5 to 777 tokens; the chunked run below takes 1,000
        ref = llm.engine.prompt_logits(prompt)
        ours = whole.engine.prompt_logits(prompt)
        assert (ours - ref).abs().max() < BF16_LOGIT_TOLERANCE, len(prompt)
        assert ours.argmax() == ref.argmax(), len(prompt)
    assert calls and max(calls) == 0
    del whole
    chunked = LLM(str(model_path), dtype="bfloat16", max_num_batched_tokens=96,
                  prefill_attention_backend=backend.name, quantization="none", **SMALL_ENGINE)
    prompt = _prompts(llm)[-1]  # 1,000 tokens: eleven chunks
    result = chunked.generate({"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=1, temperature=0))[0]
    assert max(calls) >= 900  # the last chunks started deep into the prompt
    assert result.outputs[0].token_ids[0] == llm.engine.prompt_logits(prompt).argmax().item()
