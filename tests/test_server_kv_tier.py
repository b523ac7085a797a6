"""The disk KV tier through real server processes and the official SDKs: a prefix answered by
one process is read from disk by the next one after SIGTERM (cached_tokens says so, and the
output is cache off's), a cache_control 1h pin survives the restart and expires on schedule,
and the tier's metrics report it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from radixserve import LLM, SamplingParams
from radixserve.testing.server import ServerProcess, read_metrics, wait_idle
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"


def _openai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _anthropic(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=300)


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tier")


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[LLM]:
    llm = LLM(str(model_path), dtype="float32", prefix_cache="off", kv_cache_tokens=4096,
              show_progress=False)
    yield llm


def _prompts(llm: LLM) -> tuple[list[int], list[int], list[int]]:
    """A ~2,000-token document, and two questions about it."""
    tok = llm.tokenizer
    document = tok.encode("".join(f"Entry {i}: the ledger shows {i * 7} crates of tea shipped "
                                  f"to port {i % 13}. " for i in range(100)))
    return (document, document + tok.encode(" Which port got the most?"),
            document + tok.encode(" How many crates in total?"))


SYSTEM = ("You are the night-desk assistant of a small hotel. Answer guests politely and "
          "briefly. ") * 12


def _ask_with_pin(client: anthropic.Anthropic, question: str) -> anthropic.types.Message:
    return client.messages.create(
        model=MODEL, max_tokens=4,
        system=[{"type": "text", "text": SYSTEM,
                 "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": question}])


def test_a_restarted_server_reads_what_the_last_one_computed(tier_dir, reference,
                                                            tmp_path_factory):
    document, first, second = _prompts(reference)
    assert len(document) >= 1900
    # float32 as the reference runs (dtype auto would be bfloat16 on AVX512-BF16 machines).
    flags = ("--kv-offload-dir", str(tier_dir), "--enable-clock-control", "--dtype", "float32")
    with running_server(tmp_path_factory, *flags, name="before") as before:
        with _openai(before) as client:
            client.completions.create(model=MODEL, prompt=first, max_tokens=4, temperature=0)
        with _anthropic(before) as client:
            _ask_with_pin(client, "Is breakfast included?")
        metrics = wait_idle(before.base_url)
        assert metrics["kv_tier_bytes_written_total"] > 0
    with running_server(tmp_path_factory, *flags, name="after") as after:
        metrics = read_metrics(after.base_url)
        assert metrics["kv_tier_entries"] >= len(document) // 64
        assert metrics["kv_tier_pinned_entries"] > 0  # the 1h pin, back from disk
        with _openai(after) as client:
            response = client.completions.create(model=MODEL, prompt=second, max_tokens=8,
                                                 temperature=0)
        cached = response.usage.prompt_tokens_details.cached_tokens
        question = len(second) - len(document)
        assert cached >= len(second) - question - 64  # all but the last partial block
        assert cached == len(document) // 64 * 64
        expected = reference.generate({"prompt_token_ids": second},
                                      SamplingParams(max_tokens=8, temperature=0),
                                      use_tqdm=False)[0]
        assert response.choices[0].text == expected.outputs[0].text
        metrics = wait_idle(after.base_url)
        assert metrics["kv_tier_hits_total"] == cached
        assert metrics["kv_tier_load_seconds_count"] == 1
        assert metrics["prompt_tokens_computed_total"] == len(second) - cached

        # The pinned system prompt is read from disk and pinned in the pool for the time
        # its pin has left; once that passes, nothing is pinned anywhere.
        with _anthropic(after) as client:
            message = _ask_with_pin(client, "Is there parking?")
        assert message.usage.cache_read_input_tokens > 0
        metrics = wait_idle(after.base_url)
        assert metrics["kv_cache_tokens{state=pinned}"] > 0
        httpx.post(after.base_url + "/debug/clock/advance", json={"seconds": 3700.0},
                   timeout=10).raise_for_status()
        metrics = read_metrics(after.base_url)
        assert metrics["kv_cache_tokens{state=pinned}"] == 0
        assert metrics["kv_tier_pinned_entries"] == 0
        assert sum(v for k, v in metrics.items() if k.startswith("kv_tier_errors_total")) == 0

