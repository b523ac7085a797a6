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


# Settings for a small, quiet engine: tests keep pools small and outputs short.
SMALL_ENGINE = dict(kv_cache_tokens=8192, show_progress=False, debug_invariants=True)


def use_decode_backend(monkeypatch: pytest.MonkeyPatch, llm, name: str) -> None:
    """Switches a live engine's decode attention to the backend called `name` for one test."""
    import dataclasses

    from radixserve.layers.attention import choose_backend

    runner = llm.engine.runner
    decode = choose_backend("decode", name, runner.attention.decode.env)
    monkeypatch.setattr(runner, "attention", dataclasses.replace(runner.attention, decode=decode))
