"""The model-family suite's machinery: what a family's tiny checkpoint is and what the suite
checks of it (`Family`), the checkpoint saved as an HF directory with a real tokenizer,
converted to GGUF by llama.cpp's converter and requantized (`FamilyCheckpoints`, built once a
session), and the parity measures against transformers in float32."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve import LLM, SamplingParams
from radixserve.model.loader import load_tokenizer
from tests.support.gguf_requantize import requantize_gguf
from tests.support.llama_converter import LlamaConverter
from tests.support.workloads import mixed_workload, run_rounds

# Small engines: a few short prompts, float32 like the reference.
TINY_ENGINE = dict(dtype="float32", kv_cache_tokens=4096, show_progress=False,
                   debug_invariants=True)
# Float32 both sides; the only differences are summation orders (fused q/k/v, attention, an
# expert mixture's weighted sum).
LOGIT_TOLERANCE = 1e-4
Mutation = Callable[[LLM], None]


def random_prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(200, 40000, (n,), generator=generator).tolist() for n in lengths]


# Three prompts, the longest several sliding windows long; greedy decoding after 50 tokens.
PROMPTS = random_prompts((7, 40, 100))


@dataclass(frozen=True)
class ParityRun:
    """Prompts whose next-token logits must match transformers' on one engine (built with
    `settings`), and one whose greedy continuation must."""

    prompts: list[list[int]] = field(default_factory=lambda: PROMPTS)
    greedy_prompt: list[int] = field(default_factory=lambda: PROMPTS[2][:50])
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One family's tiny random-weight checkpoint and what the suite checks of it."""

    name: str  # the registry's family name (ModelConfig.family)
    build: Callable[[], torch.nn.Module]  # the transformers model, seeded, in float32
    gguf_architecture: str  # general.architecture of the converter's file
    # ModelConfig fields (dotted for nested ones) the engine must read, from either source.
    features: dict[str, Any]
    # Mutations that drop or change one feature: the parity check must catch each.
    mutations: dict[str, Mutation]
    runs: tuple[ParityRun, ...] = (ParityRun(),)
    # Checks of an engine on the HF directory beyond its logits (which blocks it built).
    check_engine: Callable[[LLM], None] | None = None
    # The GGUF copy's block type, and its agreement with its own blocks dequantized: the RMS
    # of the logit difference over the logits' spread, with int8 activations (as llama.cpp
    # multiplies quantized blocks). Measured 0.014-0.044 across families.
    quantized_type: str = "Q8_0"
    quantized_tolerance: float = 0.15
    # Float matrices quantized to Q4_1 at load, against the float weights (None: not
    # checked). Measured 0.20-0.73: 4-bit Gaussian weights, and a tied embedding table is Q4_1
    # too (the default model's own Q4_1 blocks measure 0.79 against float).
    int4_tolerance: float | None = 1.0
    # Checks of an engine running quantized blocks (the copy's, and int4's).
    check_quantized: Callable[[LLM], None] | None = None
    # Which copy the cache on == off check runs ("directory" or "gguf_quantized").
    cache_source: str = "directory"

    @property
    def prompts(self) -> list[list[int]]:
        """The prompts of the quantized and mutation checks (the last run's)."""
        return self.runs[-1].prompts


@dataclass(frozen=True)
class FamilyCheckpoint:
    """One tiny model as transformers runs it, saved as an HF directory, converted to GGUF
    by llama.cpp's converter, and that file requantized to the family's block type."""

    hf: torch.nn.Module
    directory: Path
    gguf: Path
    gguf_quantized: Path


class FamilyCheckpoints:
    """Each family's checkpoint, built on first use and kept for the session, in `folder`."""

    def __init__(self, folder: Path, tokenizer_model: Path) -> None:
        self.folder = folder
        self.tokenizer_model = tokenizer_model
        self.converter = LlamaConverter(folder / "converter.log")
        self.built: dict[str, FamilyCheckpoint] = {}

    def get(self, family: Family) -> FamilyCheckpoint:
        if family.name not in self.built:
            self.built[family.name] = self._build(family)
        return self.built[family.name]

    def _build(self, family: Family) -> FamilyCheckpoint:
        folder = self.folder / family.name
        hf = family.build().float().eval()
        directory = save_checkpoint(hf, folder / "hf", self.tokenizer_model)
        gguf = self.converter.convert(directory, folder / "model-f32.gguf")
        quantized = requantize_gguf(gguf, folder / f"model-{family.quantized_type.lower()}.gguf",
                                    family.quantized_type)
        return FamilyCheckpoint(hf, directory, gguf, quantized)

    def close(self) -> None:
        self.converter.close()


def save_checkpoint(model: torch.nn.Module, directory: Path, tokenizer_model: Path) -> Path:
    """Saves an HF model with a real vocabulary (any of the right size will do: the reference
    needs only token ids), as a tokenizer llama.cpp's converter recognises."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = load_tokenizer(tokenizer_model)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        # GPT-2's class keeps tokenizer.json's pre-tokenizer, which the converter knows by
        # its hash (a model_type's own class, Qwen2's say, would rebuild it), and is what
        # the converter reads Phi-4's vocabulary by.
        "tokenizer_class": "GPT2Tokenizer",
    }))
    return directory


def perturb_norms(model: torch.nn.Module, mean: float, std: float, seed: int = 2) -> None:
    """Random norm weights around `mean` (1 for w, 0 for Gemma's 1 + w), so that a norm read
    the wrong way shows in the logits (a fresh model's norms are all alike)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(mean + std * torch.randn(parameter.shape, generator=generator))


def fresh_llm(source: Path, mutate: Mutation | None = None, **settings) -> LLM:
    """An engine on `source` with TINY_ENGINE's settings (and `settings`), its model changed
    by `mutate` where given (the mutation checks)."""
    llm = LLM(str(source), **{**TINY_ENGINE, **settings})
    if mutate is not None:
        mutate(llm)
    return llm


def logit_gaps(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the largest difference between our next-token logits and transformers'."""
    gaps = []
    for ids in prompts:
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0, -1].float()
        gaps.append((llm.engine.prompt_logits(ids) - expected).abs().max().item())
    return gaps


def greedy_divergence(llm: LLM, hf: torch.nn.Module, prompt: list[int],
                      tokens: int) -> int | None:
    """Where our greedy tokens after `prompt` first differ from transformers' greedy choice
    (None: never). HF's argmax after the prompt and after each of our tokens, from one
    forward pass, equals our tokens exactly when its own greedy generation would."""
    ours = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    got = ours[0].outputs[0].token_ids
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1:]
    expected = logits.argmax(dim=-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b),
                None)


def quantized_gaps(quantized: LLM, reference: LLM, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the RMS of the logit difference between a quantized engine and its float
    reference over the reference logits' standard deviation (the measure
    tests/test_gguf_types.py states its quantized tolerance in)."""
    gaps = []
    for ids in prompts:
        want, got = reference.engine.prompt_logits(ids), quantized.engine.prompt_logits(ids)
        gaps.append(((got - want).pow(2).mean().sqrt() / want.std()).item())
    return gaps


def cache_and_chunking_runs(source: Path, **engine: Any
                            ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of a mixed workload (shared prefixes, multi-turn, branches) with the
    radix cache and 16-token prefill chunks, and with no cache in one chunk: they must be
    equal exactly (a wrong cached K/V or a chunk boundary that changed a bit would show).
    `engine`: further settings of both engines (e.g. the device)."""
    runs, hits = [], []
    for settings in (dict(prefix_cache="radix", max_num_batched_tokens=16),
                     dict(prefix_cache="off")):
        llm = fresh_llm(source, **engine, **settings)
        runs.append(run_rounds(llm, mixed_workload(llm)))
        hits.append(llm.engine.scheduler.counters.prefix_cache_hits)
        stats = llm.pool_stats()
        assert stats.private == 0 and stats.protected == 0, stats
    assert hits[0] > 0 and hits[1] == 0, hits
    return runs[0], runs[1]
