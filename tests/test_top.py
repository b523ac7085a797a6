"""`radixserve top`: a frame rendered from a canned stats document (figures, escaping), the
errors a script sees (exit 1 unreachable, 2 refused key), and one `--once` against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from radixserve.testing.server import ServerProcess, free_port
from radixserve.top import escape, render_frame
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

NOW = 1_733_068_800.0


def _node(node_id: str, text: str, depth: int, tokens: int, hits: int, served: int,
          children: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": node_id, "text": text, "tokens": tokens, "depth": depth, "hits": hits,
            "served_tokens": served, "last_used_s_ago": 3.2, "locks": 0, "pinned_for_s": None,
            "namespace": "default", "children": children or [], **extra}


def canned_stats() -> dict[str, Any]:
    """Ten one-second buckets ago nothing was cached; in the last ten, 3 of 4 tokens were."""
    quiet, busy = [0] * 290, [2] * 10
    return {
        "now": NOW, "model": "SmolLM2-135M-Instruct", "uptime_s": 3723.0, "window": "5m",
        "totals": {"requests": 120, "prompt_tokens": 48_000, "cached_tokens": 30_000,
                   "computed_prompt_tokens": 18_000, "hit_rate": 0.625, "kv_tier_hits": 0},
        "series": {"interval_s": 1, "t": [NOW - 299 + i for i in range(300)],
                   "requests": quiet + busy,
                   "prompt_tokens": [100] * 290 + [400] * 10,
                   "cached_tokens": [0] * 290 + [300] * 10,
                   "hit_rate": [0.0] * 290 + [0.75] * 10,
                   "ttft_p50_s": [None] * 298 + [0.041, None],
                   "ttft_p99_s": [None] * 298 + [0.3104, None],
                   "pool": {s: [0] * 300 for s in ("free", "evictable", "protected", "pinned",
                                                   "private")}},
        "pool": {"total": 8192, "free": 4096, "evictable": 2048, "protected": 1024,
                 "pinned": 512, "private": 512},
        "cost": {"profile": "claude-sonnet-4-5", "with_cache_usd": 0.0123,
                 "without_cache_usd": 0.0456, "saved_usd": 0.0333, "saved_usd_per_hour": 0.0322},
        "tenants": [{"namespace": "salt:\x1b[31mred", "requests": 20, "prompt_tokens": 8000,
                     "cached_tokens": 2000, "hit_rate": 0.25, "tokens_saved": 2000},
                    {"namespace": "default", "requests": 100, "prompt_tokens": 40_000,
                     "cached_tokens": 28_000, "hit_rate": 0.7, "tokens_saved": 28_000}],
        "tree": {"nodes": 345, "shown": 3, "truncated": True, "roots": [
            _node("n1", "You are a helpful\nassistant", 0, 52, 9, 468, [
                _node("n2", "Summarize:", 52, 4, 3, 12, locks=1, pinned_for_s=290.0)]),
            _node("n3", "<script>alert(1)</script>", 0, 7, 1, 7)]},
        "recent": [
            {"id": "r1", "api": "openai", "at": NOW - 5, "prompt_tokens": 60, "cached_tokens": 0,
             "ttft_s": 0.2, "cost_usd": 0.00018, "miss_at": 0, "miss_text": "Hello\tthere"},
            {"id": "r2", "api": "anthropic", "at": NOW - 1, "prompt_tokens": 400,
             "cached_tokens": 399, "ttft_s": None, "cost_usd": None, "miss_at": None,
             "miss_text": ""}],
    }


def test_frame_shows_the_figures() -> None:
    frame = render_frame(canned_stats())
    assert "SmolLM2-135M-Instruct - up 1h02m" in frame
    # now: 3000 of 4000 tokens in the last 10 s; 5 min: 3000 of 33000; since start: totals.
    assert "now 75.0%" in frame and "5 min 9.1%" in frame and "since start 62.5%" in frame
    assert "requests/s 2.0" in frame
    assert "TTFT p50 41 ms   p99 310 ms" in frame  # the latest bucket that has a figure
    assert "saved $0.0333 ($0.03/h)" in frame and "(claude-sonnet-4-5)" in frame
    pool = frame.splitlines()[frame.splitlines().index("KV pool  8,192 tokens") + 1]
    # 1/16 private, 1/8 protected, 1/16 pinned, 1/4 evictable, 1/2 free of a 98-wide bar
    # (the boundaries rounded: 6.1, 18.4, 24.5, 49, 98).
    assert pool == "[" + "#" * 6 + "=" * 12 + "+" * 6 + "-" * 25 + "." * 49 + "]"
    assert "# private 512  = protected 1,024  + pinned 512  - evictable 2,048  . free 4,096" in frame
    tenants = [line.split()[0] for line in frame.splitlines()
               if line.startswith(("default", "salt:"))]
    assert tenants == ["default", "salt:\\x1b[31mred"]  # by requests, escaped
    assert re.search(r'^"You are a helpful\\nassistant"\s+52\s+9\s+468\s+3s\s+0  -$', frame, re.M)
    assert re.search(r'^  "Summarize:"\s+4\s+3\s+12\s+3s\s+1  4m50s$', frame, re.M)
    assert '"<script>alert(1)</script>"' in frame
    assert "345 nodes" in frame
    newest, older = (line for line in frame.splitlines() if re.search(r"openai|anthropic", line))
    assert re.search(r"1s\s+anthropic\s+400\s+399\s+-\s+-  -$", newest)
    assert re.search(r'5s\s+openai\s+60\s+0\s+200 ms\s+0.00018  token 0: "Hello\\tthere"$', older)
    assert "\x1b" not in frame


def test_frame_fits_the_width_and_survives_an_idle_server() -> None:
    assert all(len(line) <= 60 for line in render_frame(canned_stats(), 60).splitlines())
    idle = render_frame({"now": NOW, "model": "m", "uptime_s": 1.0, "series": {}, "totals": {},
                         "pool": {"total": 8192, "free": 8192}, "cost": {}, "tenants": [],
                         "tree": {"nodes": 0, "roots": []}, "recent": []})
    assert "now -" in idle and "TTFT p50 -" in idle and "(none yet)" in idle
    assert "[" + "." * 98 + "]" in idle


def test_escape_keeps_text_but_not_control_characters() -> None:
    assert escape("café 東京 ok") == "café 東京 ok"
    assert escape("a\nb\x1b[2J\u202e\x00") == "a\\nb\\x1b[2J\\u202e\\x00"


def _top(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixserve.cli", "top", "--once", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RADIXSERVE_API_KEY": "", **(env or {})})


def test_unreachable_server_is_one_line_and_exit_1() -> None:
    done = _top("--url", f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "cannot fetch the stats" in done.stderr


KEY = "sk-top-test"


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--api-key", KEY) as proc:
        yield proc


def test_once_against_a_real_server(server: ServerProcess) -> None:
    refused = _top("--url", server.base_url)
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1
    assert "401" in refused.stderr and "--api-key" in refused.stderr
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        for _ in range(2):
            client.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2,
                                      prompt="The radix tree shares prefixes between prompts")
    done = _top("--url", server.base_url, env={"RADIXSERVE_API_KEY": KEY})
    assert done.returncode == 0, done.stderr
    assert "SmolLM2-135M-Instruct" in done.stdout and "KV pool  8,192 tokens" in done.stdout
    assert "The radix tree" in done.stdout  # the shared prefix, in the tree and recent misses
    assert re.search(r"\d+ requests, [1-9][\d,]* of", done.stdout)  # something was cached
