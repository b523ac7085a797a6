"""Shared fixtures: the default model's path (fetched once), the HF oracle, its tokenizer and
word bank, and a real server with an `openai` client for modules that need no special flags
(a module that defines its own `server` or `client` uses that instead). The helpers behind
them live in tests/support."""

# ruff: noqa: E402 (the environment is set before the imports that load torch)
from __future__ import annotations

import os

# Before torch loads OpenMP (which reads it once): the suite runs two workers and their server
# processes on two cores, so a thread waiting between parallel regions must sleep, not spin on
# a core another process needs (spinning made four of its modules 1.5-2.4x slower, side by
# side). Servers inherit it; a
# value set outside wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from hypothesis import settings

from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.testing.server import ServerProcess
from tests.support.engine import load_hf_gguf
from tests.support.servers import openai_client, running_server

# Two cores: more threads than cores makes torch's OpenMP workers spin against each other.
torch.set_num_threads(2)

# Property tests draw the same examples on every run, so a CI failure replays here; set
# HYPOTHESIS_PROFILE=explore to draw fresh examples (and keep the failures hypothesis finds).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


# `make test` runs two xdist workers, each taking whole modules in collection order: the
# longest modules go first so that neither worker is left with one at the end.
LONGEST_FIRST = ("test_replicas.py", "test_gemma3_270m.py", "test_claude_code_full_prompt.py",
                 "test_claude_code.py", "test_replicas_responses.py", "test_parity_hf.py",
                 "test_prefix_cache_engine.py", "test_server_overload.py",
                 "test_family_suite.py", "test_server_kv_tier.py", "test_server_openai.py")



@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path: Path):
    """The oracle: HF transformers' Llama on the same GGUF weights, dequantized to float32
    (once per session, shared by the modules that need it)."""
    pytest.importorskip("transformers")
    return load_hf_gguf(model_path.parent, model_path.name)


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> ChatTokenizer:
    """The default model's tokenizer and chat template."""
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def bank(tokenizer: ChatTokenizer) -> WordBank:
    """Words that are one token each in the default model's vocabulary."""
    return WordBank.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with no special flags, one per module that does not define its own."""
    with running_server(tmp_path_factory) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that reaches the default model through a fixture must say so (`model` marker), or
    `make test-fast` would fetch and load it. Then the longest modules go first."""
    unmarked = [item.nodeid for item in items
                if "model_path" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("model") is None]
    if unmarked:
        raise pytest.UsageError("needs the model but is not marked `model`: " + ", ".join(unmarked))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within
