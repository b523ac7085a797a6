"""cache_control TTLs as KV pins, against a real server with a small pool and a clock the test
moves forward: a pinned prefix survives eviction pressure that evicts an unpinned one, a read
refreshes its pin, and after expiry it is evicted like any other prefix.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from radixserve.bench.textgen import WordBank
from radixserve.testing.server import ServerProcess, wait_idle
from tests.support.servers import anthropic_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "claude-sonnet-4-6"
POOL = 1024
PREFIX = 200  # tokens in each system prompt
PRESSURE = 750  # tokens in each unrelated prompt: two of them flush everything unpinned


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--kv-cache-tokens", str(POOL), "--enable-clock-control", "--max-pinned-fraction", "0.5", name="anthropic-ttl") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic_client(server) as c:
        yield c


def test_pins_outlive_pressure_until_their_ttl(client: anthropic.Anthropic,
                                               server: ServerProcess, bank: WordBank) -> None:
    rng = random.Random(7)
    pinned_text, unpinned_text = bank.distinct_texts(rng, 2, PREFIX)
    seeds = itertools.count(1000)

    def ask(system: list[dict[str, object]]) -> int:
        """Cached tokens (engine truth) of a request with this system prompt."""
        r = client.messages.create(model=MODEL, max_tokens=1, system=system,
                                   messages=[{"role": "user", "content": "Hi."}])
        return r.usage.cache_read_input_tokens

    def pressure() -> None:
        """Two unrelated prompts that together need every slot no pin holds."""
        for _ in range(2):
            text = bank.text(random.Random(next(seeds)), PRESSURE)
            client.messages.create(model=MODEL, max_tokens=1,
                                   messages=[{"role": "user", "content": text}])

    def advance(seconds: float) -> None:
        httpx.post(server.base_url + "/debug/clock/advance", json={"seconds": seconds},
                   timeout=30).raise_for_status()

    def pinned_slots() -> float:
        return wait_idle(server.base_url)["kv_cache_tokens{state=pinned}"]

    pinned = [{"type": "text", "text": pinned_text, "cache_control": {"type": "ephemeral"}}]
    unpinned = [{"type": "text", "text": unpinned_text}]
    ask(pinned)
    ask(unpinned)
    assert pinned_slots() >= PREFIX

    pressure()
    assert ask(pinned) >= PREFIX  # the pin held (and this read refreshes it)
    assert ask(unpinned) < 20  # evicted: only the template's opening tokens are shared

    advance(200)
    assert ask(pinned) >= PREFIX  # refreshes the pin: now alive until 500 s
    advance(200)  # 400 s after the read before: only the refresh keeps it
    pressure()
    assert ask(pinned) >= PREFIX

    advance(301)  # past the last read's 5 minutes
    pressure()
    assert pinned_slots() == 0
    assert ask(pinned) < 20  # expired, then evicted like any other prefix
