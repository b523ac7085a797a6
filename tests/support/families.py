"""Model-family test helpers: a tiny random-weight checkpoint saved as an HF directory with a
real tokenizer, the same checkpoint written as GGUF by llama.cpp's own converter (from the
llama-cpp-python sdist, fetched once into the cache) and requantized with gguf-py, and the
parity measures against transformers in float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.home import cache_home
from radixserve.model.loader import load_tokenizer
from tests.support.workloads import mixed_workload, run_rounds

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
# What the converter needs from the sdist's vendored llama.cpp tree.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
TEMPLATES_PART = "models/templates/"  # the families' own chat templates
# Small engines: a few short prompts, float32 like the reference.
TINY_ENGINE = dict(dtype="float32", kv_cache_tokens=4096, show_progress=False,
                   debug_invariants=True)


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


def llama_cpp_tree() -> Path:
    """The converter's part of the llama.cpp tree vendored in the llama-cpp-python sdist:
    $RADIXSERVE_LLAMA_CPP_SRC, or fetched once with pip into the cache (skips the test where
    pip cannot fetch it)."""
    if os.environ.get("RADIXSERVE_LLAMA_CPP_SRC"):
        return Path(os.environ["RADIXSERVE_LLAMA_CPP_SRC"])
    return _sdist_parts("llama_cpp_converter", CONVERTER_PARTS, "convert_hf_to_gguf.py")


def family_chat_template(file_name: str) -> str:
    """A model family's own chat template, as llama.cpp's tree keeps it
    (models/templates/FILE_NAME), from the same sdist."""
    if os.environ.get("RADIXSERVE_LLAMA_CPP_SRC"):
        tree = Path(os.environ["RADIXSERVE_LLAMA_CPP_SRC"])
    else:
        tree = _sdist_parts("llama_cpp_templates", (TEMPLATES_PART,), TEMPLATES_PART)
    return (tree / TEMPLATES_PART / file_name).read_text()


def _sdist_parts(folder: str, parts: tuple[str, ...], marker: str) -> Path:
    tree = cache_home() / folder / LLAMA_CPP_SDIST.replace("==", "-")
    if (tree / marker).exists():
        return tree
    with tempfile.TemporaryDirectory() as download:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             "--quiet", LLAMA_CPP_SDIST, "-d", download], capture_output=True, text=True)
        sdists = list(Path(download).glob("*.tar.gz"))
        if fetched.returncode or not sdists:
            pytest.skip(f"cannot fetch {LLAMA_CPP_SDIST}: {fetched.stderr}")
        extract_parts(sdists[0], tree, parts)
    return tree


def extract_parts(sdist: Path, tree: Path, parts: tuple[str, ...] = CONVERTER_PARTS) -> None:
    """Unpacks `parts` of the sdist's llama.cpp tree into `tree` (atomically)."""
    staging = Path(tempfile.mkdtemp(dir=tree.parent if tree.parent.exists() else None))
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, inner = member.name.partition("/vendor/llama.cpp/")
            if inner and inner.startswith(parts):
                member.name = inner
                members.append(member)
        archive.extractall(staging, members=members, filter="data")
    tree.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(tree)


def convert_to_gguf(directory: Path, outfile: Path) -> Path:
    """The HF directory written as a float32 GGUF by llama.cpp's convert_hf_to_gguf.py."""
    converter = llama_cpp_tree() / "convert_hf_to_gguf.py"
    done = subprocess.run([sys.executable, str(converter), str(directory), "--outfile",
                           str(outfile), "--outtype", "f32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return outfile


def requantize_gguf(source: Path, outfile: Path, type_name: str) -> Path:
    """A copy of a float GGUF whose matrices are `type_name` blocks (gguf-py's quantizer,
    ggml's reference rounding), as llama-quantize leaves norms and vectors in float32."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(outfile), bytes(arch.parts[arch.data[0]]).decode())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            value = [bytes(field.parts[i]).decode() if sub == gguf.GGUFValueType.STRING
                     else field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, value, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[field.data[0]]).decode(), kind)
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    qtype = gguf.GGMLQuantizationType[type_name]
    for tensor in reader.tensors:
        data = tensor.data.reshape([int(n) for n in reversed(tensor.shape)])
        # As llama-quantize: matrices and 3-D expert stacks in blocks; routers and biases float.
        if (data.ndim >= 2 and data.shape[-1] % 32 == 0
                and not tensor.name.endswith((".bias", "ffn_gate_inp.weight"))):
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return outfile


def random_prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(200, 40000, (n,), generator=generator).tolist() for n in lengths]


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


def greedy_tokens(llm: LLM, prompts: list[list[int]], tokens: int = 8) -> list[list[int]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [r.outputs[0].token_ids for r in results]


def fresh_llm(source: Path, mutate: Callable[[LLM], None] | None = None, **settings) -> LLM:
    """An engine on `source` with TINY_ENGINE's settings (and `settings`), its model changed
    by `mutate` where given (the mutation checks)."""
    llm = LLM(str(source), **{**TINY_ENGINE, **settings})
    if mutate is not None:
        mutate(llm)
    return llm


@dataclass(frozen=True)
class FamilyCheckpoint:
    """One tiny model as transformers runs it, saved as an HF directory, converted to GGUF
    by llama.cpp's converter, and that file requantized to Q8_0."""

    hf: torch.nn.Module
    directory: Path
    gguf: Path
    gguf_q8_0: Path


def build_family_checkpoint(hf: torch.nn.Module, folder: Path,
                            tokenizer_model: Path) -> FamilyCheckpoint:
    hf = hf.float().eval()
    directory = save_checkpoint(hf, folder / "hf", tokenizer_model)
    gguf = convert_to_gguf(directory, folder / "model-f32.gguf")
    return FamilyCheckpoint(hf, directory, gguf,
                            requantize_gguf(gguf, folder / "model-q8_0.gguf", "Q8_0"))


def cache_and_chunking_runs(source: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of a mixed workload (shared prefixes, multi-turn, branches) with the
    radix cache and 16-token prefill chunks, and with no cache in one chunk: they must be
    equal exactly (a wrong cached K/V or a chunk boundary that changed a bit would show)."""
    runs, hits = [], []
    for settings in (dict(prefix_cache="radix", max_num_batched_tokens=16),
                     dict(prefix_cache="off")):
        llm = fresh_llm(source, **settings)
        runs.append(run_rounds(llm, mixed_workload(llm)))
        hits.append(llm.engine.scheduler.counters.prefix_cache_hits)
        stats = llm.pool_stats()
        assert stats.private == 0 and stats.protected == 0, stats
    assert hits[0] > 0 and hits[1] == 0, hits
    return runs[0], runs[1]


def perturb_norms(model: torch.nn.Module, mean: float, std: float, seed: int = 2) -> None:
    """Random norm weights around `mean` (1 for w, 0 for Gemma's 1 + w), so that a norm read
    the wrong way shows in the logits (a fresh model's norms are all alike)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(mean + std * torch.randn(parameter.shape, generator=generator))


def quantized_gaps(quantized: LLM, reference: LLM, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the RMS of the logit difference between a quantized engine and its float
    reference over the reference logits' standard deviation (the measure
    tests/test_gguf_types.py states its quantized tolerance in)."""
    gaps = []
    for ids in prompts:
        want, got = reference.engine.prompt_logits(ids), quantized.engine.prompt_logits(ids)
        gaps.append(((got - want).pow(2).mean().sqrt() / want.std()).item())
    return gaps
