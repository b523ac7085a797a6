"""Shared fixtures: the default model's path (fetched once), the HF oracle, small-engine
settings, and a real server with an `openai` client for modules that need no special flags
(a module that defines its own `server` or `client` uses that instead)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from radixserve.model.default_model import default_model_path
from radixserve.testing.server import ServerProcess, start_server

# Two cores: more threads than cores makes torch's OpenMP workers spin against each other.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


def load_hf_gguf(folder: Path, name: str):
    """HF transformers' model of the GGUF file folder/name, dequantized to float32."""
    import functools

    import gguf
    import transformers

    with pytest.MonkeyPatch.context() as patch:
        # HF's GGUF loader builds gguf's tensor-name table once per submodule (397 times for
        # the default model, 12 of its 16 s); the table depends only on its arguments.
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model(model_path: Path):
    """The oracle: HF transformers' Llama on the same GGUF weights, dequantized to float32
    (once per session, shared by the modules that need it)."""
    pytest.importorskip("transformers")
    return load_hf_gguf(model_path.parent, model_path.name)


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


@contextlib.contextmanager
def running_server(tmp_path_factory: pytest.TempPathFactory, *flags: str,
                   name: str = "server") -> Iterator[ServerProcess]:
    """`radixserve serve` on the default model with a small pool, 2 threads and invariant
    checks, plus `flags` (a later flag wins over a default); it must stop cleanly and log no
    serious error."""
    proc = start_server(["--kv-cache-tokens", "8192", "--num-threads", "2", "--debug-invariants",
                         "--no-access-log", *flags],
                        tmp_path_factory.mktemp(name) / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert not proc.serious_errors(), proc.log()


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with no special flags, one per module that does not define its own."""
    with running_server(tmp_path_factory) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c
