"""`radixserve bench` against a real radixserve server process on a loopback port: the JSON and
the report are written, and the cache hits what the workload implies, request by request."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixserve.bench.results import BenchResult
from radixserve.cli import main
from radixserve.model.default_model import default_model_path

pytestmark = [
    pytest.mark.model,
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("radixserve.server.app") is None,
        reason="the OpenAI server (radixserve.server.app) is not there yet",
    ),
]

PAGE_SIZE = 1  # token-granular, so every request's cached tokens are exactly predictable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--model",
        str(default_model_path()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefix-cache",
        "radix",
        "--kv-cache-tokens",
        "4096",
        "--page-size",
        str(PAGE_SIZE),
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _bench(url: str, out: Path, workload: str, *extra: str) -> BenchResult:
    path = out / f"{workload}.json"
    status = main(
        [
            "bench",
            "--base-url",
            url,
            "--workload",
            workload,
            "--tokenizer",
            str(default_model_path()),
            "--output-len",
            "4",
            "--max-concurrency",
            "1",
            "--num-warmups",
            "1",
            "--ideal-page-size",
            str(PAGE_SIZE),
            "--no-progress",
            "--system",
            "radixserve-radix",
            "--metadata",
            "prefix_cache=radix",
            "--result-file",
            str(path),
            *extra,
        ]
    )
    assert status == 0
    return BenchResult.load_file(path)


def test_bench_against_a_real_server(server: str, tmp_path: Path) -> None:
    shared = _bench(
        server,
        tmp_path,
        "shared-prefix",
        "--num-prompts",
        "6",
        "--num-prefixes",
        "2",
        "--prefix-len",
        "48",
        "--suffix-len",
        "8",
    )
    salted = _bench(
        server,
        tmp_path,
        "salted",
        "--num-prompts",
        "2",
        "--num-prefixes",
        "1",
        "--prefix-len",
        "32",
        "--suffix-len",
        "6",
        "--num-tenants",
        "2",
        "--seed",
        "1",
    )
    # Each turn carries the reply the server gave, which the server has cached as it made it.
    chat = _bench(
        server,
        tmp_path,
        "multi-turn",
        "--num-prompts",
        "1",
        "--num-turns",
        "3",
        "--prefix-len",
        "16",
        "--suffix-len",
        "6",
        "--seed",
        "2",
    )
    for result in (shared, salted, chat):
        s = result.summary
        assert (s.completed, s.failed, s.not_sent) == (len(result.records), 0, 0)
        assert result.command.startswith("radixserve bench --base-url")
        for r in result.records:
            # The server renders the same chat template with the same tokenizer.
            assert r.prompt_tokens == r.client_prompt_tokens
            assert r.output_tokens_source == "usage" and 1 <= r.output_tokens <= 4
            assert r.ttft is not None and r.latency >= r.ttft
            # One request at a time, a pool far larger than the workload, page size 1: the
            # cache reuses exactly the longest prefix it has seen (in the request's tenant).
            assert r.cached_tokens == r.ideal_cached_tokens, r
        assert s.cache.usage_requests_reported == s.completed  # zeros are reported, not omitted
        assert s.cache.usage_hit_rate == pytest.approx(s.cache.ideal_hit_rate)
        if s.cache.metrics_queries is not None:
            assert s.cache.metrics_hits == s.cache.usage_cached_tokens

    # shared-prefix: the second user of each system prompt reuses it in full.
    assert shared.summary.cache.usage_hit_rate > 0.4
    # salted: tenant 1's copy of a prompt misses what tenant 0 has just cached.
    first_two = salted.records[:2]
    assert first_two[0].cached_tokens == first_two[1].cached_tokens == 0
    # multi-turn: all of the previous turn's prompt is reused, and more.
    turns = chat.records
    for before, after in zip(turns, turns[1:], strict=False):
        assert after.cached_tokens >= before.prompt_tokens

    out = tmp_path / "report"
    assert (
        main(
            [
                "bench",
                "report",
                str(tmp_path / "shared-prefix.json"),
                str(tmp_path / "salted.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = (out / "report.md").read_text()
    assert "| radixserve-radix | shared-prefix |" in text and "## Commands" in text
    assert (out / "hit_rate.png").stat().st_size > 1000
