"""The OpenAI-compatible server, through the official `openai` SDK against a real server process:
chat and completions (streamed or not), n, stop, seeds, logprobs, tools, honest cached_tokens,
cache_salt, errors in OpenAI's shape with the SDK's exception classes, and client disconnects.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.bench.textgen import WordBank
from radixserve.testing.server import ServerProcess, read_metrics
from tests.support.openai_suite import (
    HELLO,
    MAX_REQUEST_BYTES,
    MODEL,
    OpenAISuite,
    assert_idle_and_clean,
)
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--max-request-bytes", str(MAX_REQUEST_BYTES), name="server") as proc:
        yield proc


class TestSingleServer(OpenAISuite):
    """The suite against one server process."""


# ----- the prefix cache, as clients see it -----


def test_cached_tokens_are_the_engine_truth(client: openai.OpenAI, server: ServerProcess,
                                            bank: WordBank) -> None:
    system = bank.text(random.Random(2024), 2000)  # exactly 2,000 tokens

    def chat(question: str, **extra: object) -> openai.types.CompletionUsage:
        r = client.chat.completions.create(
            model=MODEL, max_tokens=1,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            **extra)  # type: ignore[call-overload]
        assert r.usage is not None
        return r.usage

    before = read_metrics(server.base_url)
    first = chat("Alpha?")
    second = chat("Bravo?")
    # The whole system prompt (and the template around it) comes from the cache (page size 1).
    assert second.prompt_tokens_details.cached_tokens >= 2000 - 1  # type: ignore[union-attr]
    assert first.prompt_tokens_details.cached_tokens < 16  # type: ignore[union-attr]
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=1, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Charlie?"}])
    streamed = [c.usage for c in stream if c.usage is not None]
    assert len(streamed) == 1
    assert streamed[0].prompt_tokens_details.cached_tokens == \
        second.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # Another tenant's salt shares nothing; the same salt again shares its own entries.
    salted = chat("Alpha?", extra_body={"cache_salt": "tenant-b"})
    assert salted.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    salted_again = chat("Bravo?", extra_body={"cache_salt": "tenant-b"})
    assert salted_again.prompt_tokens_details.cached_tokens >= 2000 - 1  # type: ignore[union-attr]
    # What the responses report is what the engine counted.
    after = read_metrics(server.base_url)
    reported = [first, second, streamed[0], salted, salted_again]
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == sum(
        u.prompt_tokens_details.cached_tokens for u in reported)  # type: ignore[union-attr]
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == sum(
        u.prompt_tokens for u in reported)


def test_disconnect_while_the_submission_is_queued(client: openai.OpenAI,
                                                   server: ServerProcess) -> None:
    # A long prefill keeps the engine thread busy, so the next submissions wait in its inbox
    # when their clients leave: the case where cancelling the submission would break the
    # engine thread (see serving.EngineService._pump).
    busy = client.completions.create(model=MODEL, prompt="stone " * 3000, max_tokens=1,
                                     stream=True)
    for _ in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=50,
                                                stream=True)
        next(iter(stream))
        stream.close()
    assert [c.choices[0].finish_reason for c in busy if c.choices][-1] == "length"
    assert_idle_and_clean(server.base_url)
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).choices
