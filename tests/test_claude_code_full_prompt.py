"""The real Claude Code CLI with its own full system prompt and tools (no `--system-prompt`;
~29,000 tokens in SmolLM2's vocabulary, ~11,800 in Gemma's) for three turns of one session
(`--continue`) against a server on Gemma 3 270M (32k context; 5 of 6 layers on a 512-token
window, whose prefix hits are exact): each request of turns 2 and 3 reads at least 95% of its
prompt from the cache, though each carries a new billing header first in `system` (the server
strips it). A base model rarely stops within Claude Code's output limit, so the CLI asks again
up to three times per turn (its `max_output_tokens` recovery): every one of those counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.model.default_model import gemma3_270m_path
from radixserve.testing.server import ServerProcess
from tests.support.claude_code import CLAUDE, NOT_INSTALLED, claude, recent
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "gemma-3-270m"
FULL_PROMPT_MIN = 10_000  # Claude Code 2.1.332's system prompt and tools, in Gemma's tokens
# Turn 1 prefills the whole prompt cold on a loaded 2-core machine.
TURN_TIMEOUT_S = 1800

if not CLAUDE.exists():
    pytest.skip(NOT_INSTALLED, allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--model", str(gemma3_270m_path()),
                        "--served-model-name", MODEL, "--kv-cache-tokens", "24576",
                        name="claude-code-full") as proc:
        yield proc


def test_turns_two_and_three_read_the_full_prompt_from_the_cache(
        server: ServerProcess, tmp_path: Path) -> None:
    turns = []
    for i, flags in enumerate([(), ("--continue",), ("--continue",)], start=1):
        before = len(recent(server))
        claude(server, tmp_path, MODEL, f"Turn {i}: reply with the single word ok.", *flags,
               timeout_s=TURN_TIMEOUT_S, max_output_tokens=8)
        turns.append([row for row in recent(server)[before:]
                      if row["prompt_tokens"] >= FULL_PROMPT_MIN])
    assert all(turns), turns  # every turn sent the full prompt
    for row in turns[1] + turns[2]:
        assert row["cached_tokens"] >= 0.95 * row["prompt_tokens"], turns
    assert turns[2][0]["prompt_tokens"] > turns[0][0]["prompt_tokens"]  # one growing session
