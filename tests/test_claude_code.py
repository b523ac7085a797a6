"""The real Claude Code CLI (npm, pinned by the Makefile's `claude-code` target) in `-p` mode
against a real server on the default model: two sessions that share a ~3,000-token system
prompt. Claude Code puts a billing header, whose suffix follows characters of the session's
first message, at the head of `system`: with the server's strip on, the second session reads the shared
prefix from the cache; with it off, it reads almost nothing (the trap and the fix).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixserve.testing.server import ServerProcess
from tests.support.claude_code import CLAUDE, NOT_INSTALLED, claude, recent
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
# About 3,000 tokens of rules: Claude Code's own prompt is ~29,000, more than this model holds
# (tests/test_claude_code_full_prompt.py sends it to a 32k model).
SYSTEM_PROMPT = "".join(f"Rule {i}: keep functions short and name things for what they are.\n"
                        for i in range(200))
FLAGS = ("--tools", "", "--system-prompt", SYSTEM_PROMPT)

if not CLAUDE.exists():
    pytest.skip(NOT_INSTALLED, allow_module_level=True)


@pytest.fixture(scope="module", params=["strip", "no-strip"])
def server(request: pytest.FixtureRequest, model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, f"--{request.param}-preambles",
                        name=f"claude-code-{request.param}") as proc:
        yield proc


def shared_prefix_tokens(server: ServerProcess) -> int:
    """The tokens both sessions share: the system prompt as rendered, less a short user turn."""
    body = {"model": MODEL, "system": SYSTEM_PROMPT,
            "messages": [{"role": "user", "content": "."}]}
    counted = httpx.post(server.base_url + "/v1/messages/count_tokens", json=body, timeout=60)
    return counted.json()["input_tokens"] - 10


def test_a_second_session_reads_the_shared_prompt_only_with_the_strip(
        server: ServerProcess, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    strip = request.node.callspec.params["server"] == "strip"
    claude(server, tmp_path, MODEL, "Reply with the single word: ready.", *FLAGS)
    before = len(recent(server))
    # Claude Code derives the header's suffix from characters of the first message: this one
    # differs there, as two real sessions' first messages do.
    claude(server, tmp_path, MODEL, "Greet me in one short line, please.", *FLAGS)
    second = recent(server)[before]  # the second session's first request
    shared = shared_prefix_tokens(server)
    assert shared > 2500
    if strip:
        assert second["cached_tokens"] >= 0.95 * shared, second
    else:
        assert second["cached_tokens"] < 0.05 * shared, second
