"""The CUDA path, on a machine with a GPU (skipped elsewhere, which is CI and the CPU boxes).

Every model family on tiny random weights (built from transformers' configs), run by the engine
on CUDA: float32 logits against transformers in float32 on the same device, greedy tokens
against transformers' greedy choice, and the cache's exactness (a mixed workload with the radix
cache and 16-token prefill chunks == no cache in one chunk). bfloat16 is checked against the
float32 engine by greedy agreement (stated, not exact: rounding differs per kernel).

The tokenizer comes from the default model (the `model_path` fixture), or from
$RADIXSERVE_TEST_TOKENIZER (an HF directory with tokenizer.json) on a machine without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve import LLM, SamplingParams
from tests.support.families import (
    cache_and_chunking_runs,
    perturb_norms,
    random_prompts,
    save_checkpoint,
)
from tests.support.workloads import mixed_workload, run_rounds

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the CUDA path runs on a GPU machine"),
              pytest.mark.model]

transformers = pytest.importorskip("transformers")

LOGIT_TOLERANCE = 2e-4  # float32 both sides (TF32 off): summation orders only
PROMPTS = random_prompts((7, 40, 100))
# Phi-3's LongRoPE: transformers takes the long factors past the original context (64 here),
# the engine by its context length (512): prompts past 64 meet both on the long ones.
LONG_PROMPTS = random_prompts((65, 100, 200), seed=2)
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
            max_position_embeddings=512, initializer_range=0.1)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **BASE, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=False))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **BASE, intermediate_size=128, num_hidden_layers=2, head_dim=32,
        rope_theta=1000000.0, tie_word_embeddings=False))


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **BASE, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False))


def _phi3():
    generator = torch.Generator().manual_seed(3)
    half = int(32 * 0.75) // 2
    factors = lambda: (1 + 3 * torch.rand(half, generator=generator)).tolist()  # noqa: E731
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**BASE, "hidden_size": 128}, intermediate_size=256, num_hidden_layers=2,
        original_max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "short_factor": factors(),
                         "long_factor": factors()}))


def _smollm3():
    return transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        **BASE, intermediate_size=128, num_hidden_layers=4, rope_theta=5000000.0,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **BASE, intermediate_size=128, num_hidden_layers=6, head_dim=32, sliding_window=16,
        query_pre_attn_scalar=32, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _gpt_oss():
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **{**BASE, "max_position_embeddings": 4096}, intermediate_size=32,
        num_hidden_layers=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, tie_word_embeddings=False))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return hf


FAMILIES: dict[str, tuple[Callable[[], torch.nn.Module], float]] = {
    # name: (builder, the norms' centre: 0 for Gemma's 1 + w)
    "llama": (_llama, 1.0), "qwen3": (_qwen3, 1.0), "qwen3_moe": (_qwen3_moe, 1.0),
    "phi3": (_phi3, 1.0), "smollm3": (_smollm3, 1.0), "gemma3": (_gemma3, 0.0),
    "gpt_oss": (_gpt_oss, 1.0),
}


@pytest.fixture(scope="module")
def tokenizer_source(request: pytest.FixtureRequest) -> Path:
    if os.environ.get("RADIXSERVE_TEST_TOKENIZER"):
        return Path(os.environ["RADIXSERVE_TEST_TOKENIZER"])
    return request.getfixturevalue("model_path")


@pytest.fixture(autouse=True, scope="module")
def _exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _engine(directory: Path, **settings) -> LLM:
    return LLM(str(directory), **{"device": "cuda", "dtype": "float32", "kv_cache_tokens": 4096,
                                  "show_progress": False, "debug_invariants": True,
                                  **settings})


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int = 8) -> list[list[int]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [r.outputs[0].token_ids for r in results]


def _checkpoint(family: str, folder: Path, tokenizer_source: Path
                ) -> tuple[torch.nn.Module, Path]:
    build, norm_centre = FAMILIES[family]
    torch.manual_seed(0)
    hf = build()
    perturb_norms(hf, norm_centre, 0.3)
    hf = hf.float().eval()
    return hf, save_checkpoint(hf, folder / "hf", tokenizer_source)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_on_cuda(family: str, tmp_path: Path, tokenizer_source: Path) -> None:
    hf, directory = _checkpoint(family, tmp_path, tokenizer_source)
    hf = hf.to("cuda")

    prompts = LONG_PROMPTS if family == "phi3" else PROMPTS
    llm = _engine(directory)
    assert llm.engine.device.type == "cuda"
    gaps = []
    for ids in prompts:
        with torch.inference_mode():
            expected = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        gaps.append((llm.engine.prompt_logits(ids).to("cuda") - expected).abs().max().item())
    assert max(gaps) < LOGIT_TOLERANCE, gaps

    llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
    prompt = prompts[2][:100]
    (got,) = _greedy(llm, [prompt])
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + got[:-1]], device="cuda")).logits[0, len(prompt) - 1:]
    assert got == logits.argmax(dim=-1).tolist()

    cached_and_chunked, plain = cache_and_chunking_runs(directory, device="cuda")
    assert cached_and_chunked == plain

    float32 = _greedy(llm, prompts, 16)
    bf16 = _greedy(_engine(directory, dtype="bfloat16"), prompts, 16)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
             for x, y in zip(float32, bf16, strict=True)]
    print(f"{family}: float32 logit gaps {gaps}; bfloat16 greedy agrees for {agree} of 16")
    assert max(agree) >= 1, agree  # bfloat16 runs and picks the same first token somewhere


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_window_group_on_cuda(family: str, tmp_path: Path, tokenizer_source: Path) -> None:
    # The mixed workload's shared system prompt is far longer than the window (16): its hits
    # resume past the window, where the window group has freed the local layers' older KV.
    _, directory = _checkpoint(family, tmp_path, tokenizer_source)
    runs = []
    for memory in ("full", "window"):
        llm = _engine(directory, swa_memory=memory, max_num_batched_tokens=16)
        runs.append(run_rounds(llm, mixed_workload(llm)))
        assert llm.engine.scheduler.counters.prefix_cache_hits > 0
    assert runs[0] == runs[1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculation_on_cuda(family: str, tmp_path: Path, tokenizer_source: Path) -> None:
    _, directory = _checkpoint(family, tmp_path, tokenizer_source)
    # Prompts that repeat themselves, so that the n-gram drafter has something to propose.
    prompts = [(p[:12] * 6)[:60] for p in PROMPTS]
    plain = _greedy(_engine(directory), prompts, 24)
    llm = _engine(directory, speculative="ngram")
    assert _greedy(llm, prompts, 24) == plain
    counters = llm.engine.speculation.counters
    print(f"{family}: speculation drafted {counters.draft_tokens}, accepted "
          f"{counters.accepted_tokens}")
    assert counters.drafts > 0
