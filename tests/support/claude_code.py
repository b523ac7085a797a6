"""The real Claude Code CLI (npm, pinned by the Makefile's `claude-code` target) run in `-p`
mode against a test server, and the server's record of the requests it sent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx

from radixserve.testing.server import ServerProcess

CLAUDE = Path(__file__).resolve().parents[2] / ".node" / "node_modules" / ".bin" / "claude"
NOT_INSTALLED = "Claude Code is not installed: run `make claude-code` (needs npm)"
# Offline and small: no telemetry, no update checks, no side requests, short answers.
CLIENT_ENV = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
              "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
              "ANTHROPIC_API_KEY": "sk-local"}
CLI_TIMEOUT_S = 600  # a cold 3,000-token prefill on a loaded 2-core machine


def claude(server: ServerProcess, home: Path, model: str, prompt: str, *flags: str,
           timeout_s: float = CLI_TIMEOUT_S, max_output_tokens: int = 32) -> dict:
    """One `claude -p` invocation in `home` (its sessions live there: `--continue` goes on
    the latest); its JSON result."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
           "ANTHROPIC_BASE_URL": server.base_url, **CLIENT_ENV,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
           # The CLI's own per-request limit (10 minutes by default) must not cut a cold
           # long prefill short and send it again.
           "API_TIMEOUT_MS": str(int(timeout_s * 1000))}
    done = subprocess.run(
        [str(CLAUDE), "-p", "--output-format", "json", "--model", model, *flags, prompt],
        env=env, cwd=home, capture_output=True, text=True, timeout=timeout_s)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def recent(server: ServerProcess) -> list[dict]:
    """The server's requests, oldest first (the dashboard's data)."""
    rows = httpx.get(server.base_url + "/v1/cache/stats", timeout=60).json()["recent"]
    return rows[::-1]
