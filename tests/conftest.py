"""Shared fixtures: the default model's path (fetched once), and small-engine settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.model.default_model import default_model_path

# Two cores: more threads than cores makes torch's OpenMP workers spin against each other.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path: Path):
    """The oracle: HF transformers' Llama on the same GGUF weights, dequantized to float32
    (about 30 s to load on two cores: once per session, shared by the modules that need it)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.eval()


# Settings for a small, quiet engine: tests keep pools small and outputs short.
SMALL_ENGINE = dict(kv_cache_tokens=8192, show_progress=False, debug_invariants=True)


def use_torch_attention(monkeypatch: pytest.MonkeyPatch, llm) -> None:
    """Switches a live engine's attention to the PyTorch backends (gathers with shared-prefix
    groups for decode, SDPA for prefill) for one test."""
    import dataclasses

    from radixserve.layers.attention import choose_backend

    runner = llm.engine.runner
    env = runner.attention.decode.env
    monkeypatch.setattr(runner, "attention", dataclasses.replace(
        runner.attention, decode=choose_backend("decode", "torch", env),
        prefill=choose_backend("prefill", "sdpa", env)))


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo), to say which kernel paths it runs."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()
