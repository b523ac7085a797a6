"""Engine-side helpers shared by test modules: small-engine settings, the HF oracle's loader,
switching a live engine to the PyTorch attention backends."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

# Settings for a small, quiet engine: tests keep pools small and outputs short.
SMALL_ENGINE = dict(kv_cache_tokens=8192, show_progress=False, debug_invariants=True)


def load_hf_gguf(folder: Path, name: str) -> Any:
    """HF transformers' model of the GGUF file folder/name, dequantized to float32."""
    import gguf
    import transformers

    with pytest.MonkeyPatch.context() as patch:
        # HF's GGUF loader builds gguf's tensor-name table once per submodule (397 times for
        # the default model, 12 of its 16 s); the table depends only on its arguments.
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        # It also parses the file twice (config, then tensors), and parsing the metadata's
        # vocabulary arrays is most of a load (24 of 55 s each for Gemma 3's 262k tokens); the
        # reader is a read-only view of the file, so one serves both passes.
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=name, dtype=torch.float32)
    return model.eval()


def use_torch_attention(monkeypatch: pytest.MonkeyPatch, llm: Any) -> None:
    """Switches a live engine's attention to the PyTorch backends (gathers with shared-prefix
    groups for decode, SDPA for prefill) for one test."""
    from radixserve.layers.attention import choose_backend

    runner = llm.engine.runner
    env = runner.attention.decode.env
    monkeypatch.setattr(runner, "attention", dataclasses.replace(
        runner.attention, decode=choose_backend("decode", "torch", env),
        prefill=choose_backend("prefill", "sdpa", env)))

