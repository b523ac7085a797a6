"""`--cache-accounting vendor` through the official SDKs against a real server process: writes
only at breakpoints, reads of earlier writes, per-model minimums, concurrent first requests,
tiered invalidation, TTL expiry on the injected clock, and OpenAI's rules on the OpenAI route.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from radixserve.bench.textgen import WordBank
from radixserve.testing.server import ServerProcess
from tests.support.servers import anthropic_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

SONNET = "claude-sonnet-4-6"  # profile anthropic-1024
OPUS = "claude-opus-5"  # profile anthropic-512: shorter prompts reach its minimum
USER = [{"role": "user", "content": "Summarise the text in one line."}]
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--cache-accounting", "vendor", "--enable-clock-control", name="anthropic-vendor") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic_client(server) as c:
        yield c


def advance_clock(server: ServerProcess, seconds: float) -> None:
    r = httpx.post(server.base_url + "/debug/clock/advance", json={"seconds": seconds},
                   timeout=30)
    r.raise_for_status()


def fields(usage: Any) -> tuple[int, int, int]:
    """(read, written, uncached), checking the three add up with the breakdown."""
    creation = usage.cache_creation
    assert usage.cache_creation_input_tokens == (creation.ephemeral_5m_input_tokens
                                                 + creation.ephemeral_1h_input_tokens)
    return (usage.cache_read_input_tokens, usage.cache_creation_input_tokens,
            usage.input_tokens)


def test_system_prompt_breakpoint_writes_then_reads(client: anthropic.Anthropic,
                                                    bank: WordBank) -> None:
    system = [{"type": "text", "text": bank.text(random.Random(11), 2000),
               "cache_control": EPHEMERAL}]
    length = client.messages.count_tokens(model=SONNET, system=system, messages=USER).input_tokens
    first = client.messages.create(model=SONNET, max_tokens=2, system=system, messages=USER)
    read, written, uncached = fields(first.usage)
    # The vendor writes exactly the prefix through the breakpoint, and nothing is read.
    assert read == 0 and 2000 <= written < length and uncached == length - written
    with client.messages.stream(model=SONNET, max_tokens=2, system=system,
                                messages=USER) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        for _ in stream:
            pass
        final = stream.get_final_message().usage
    assert fields(start) == fields(final) == (written, 0, length - written)


def test_below_the_minimum_nothing_is_cached_and_nothing_fails(
        client: anthropic.Anthropic, bank: WordBank) -> None:
    system = [{"type": "text", "text": bank.text(random.Random(12), 300),
               "cache_control": EPHEMERAL}]
    for _ in range(2):
        r = client.messages.create(model=SONNET, max_tokens=1, system=system, messages=USER)
        read, written, uncached = fields(r.usage)
        assert read == written == 0 and uncached > 300


def test_concurrent_identical_first_requests_all_pay_for_the_write(
        client: anthropic.Anthropic, bank: WordBank) -> None:
    system = [{"type": "text", "text": bank.text(random.Random(13), 600),
               "cache_control": EPHEMERAL}]
    barrier = threading.Barrier(4)
    results: list[Any] = [None] * 4

    def send(i: int) -> None:
        barrier.wait()
        results[i] = client.messages.create(model=OPUS, max_tokens=1, system=system,
                                            messages=USER).usage

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    usages = [fields(u) for u in results]
    written = usages[0][1]
    assert written >= 600 and all(u == (0, written, usages[0][2]) for u in usages), usages
    after = fields(client.messages.create(model=OPUS, max_tokens=1, system=system,
                                          messages=USER).usage)
    assert after == (written, 0, usages[0][2])


def test_ttl_expiry_and_refresh_on_the_injected_clock(
        client: anthropic.Anthropic, server: ServerProcess, bank: WordBank) -> None:
    system = [{"type": "text", "text": bank.text(random.Random(14), 600),
               "cache_control": EPHEMERAL}]

    def ask() -> tuple[int, int, int]:
        return fields(client.messages.create(model=OPUS, max_tokens=1, system=system,
                                             messages=USER).usage)

    written = ask()[1]
    advance_clock(server, 200)
    assert ask()[0] == written  # read at 200 s: the 5-minute lifetime starts again
    advance_clock(server, 200)
    assert ask()[0] == written  # 400 s after the write, alive thanks to the read
    advance_clock(server, 301)
    read, rewritten, _ = ask()
    assert read == 0 and rewritten == written  # expired: a fresh write


def _tiered_body(bank: WordBank, tool: int = 0, system: int = 0, user: int = 0) -> dict[str, Any]:
    """Tools, system and the last user message each end with a breakpoint; the numbers pick
    variants of each tier."""
    return {
        "model": OPUS, "max_tokens": 1,
        "tools": [{"name": "search", "description": bank.text(random.Random(100 + tool), 560),
                   "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
                   "cache_control": EPHEMERAL}],
        "system": [{"type": "text", "text": bank.text(random.Random(200 + system), 150),
                    "cache_control": EPHEMERAL}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": bank.text(random.Random(300 + user), 40),
             "cache_control": EPHEMERAL}]}],
    }


def test_tiered_invalidation_follows_render_order(client: anthropic.Anthropic,
                                                  bank: WordBank) -> None:
    base = fields(client.messages.create(**_tiered_body(bank)).usage)
    assert base[0] == 0
    whole = base[1]  # the prefix through the last breakpoint
    system_changed = fields(client.messages.create(**_tiered_body(bank, system=1)).usage)
    user_changed = fields(client.messages.create(**_tiered_body(bank, user=1)).usage)
    tool_changed = fields(client.messages.create(**_tiered_body(bank, tool=1)).usage)
    tools_end, system_end = system_changed[0], user_changed[0]
    # A new system prompt keeps the tools; a new user message keeps tools and system; a new
    # tool keeps nothing.
    assert 560 <= tools_end < system_end < whole
    assert tool_changed[0] == 0 and tool_changed[1] > 0
    assert system_changed[1] > 0 and user_changed[1] > 0  # each writes its own new entries


def test_openai_route_follows_openais_rules(server: ServerProcess, bank: WordBank) -> None:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        def cached(messages: list[dict[str, str]]) -> tuple[int, int]:
            r = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_tokens=1)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0

        short = [{"role": "user", "content": "Say hello."}]
        for _ in range(2):
            assert cached(short)[1] == 0  # below 1,024 tokens: never cached
        long = [{"role": "system", "content": bank.text(random.Random(15), 1300)},
                {"role": "user", "content": "Hello."}]
        total, first = cached(long)
        assert first == 0  # the engine may reuse, but nothing was written before
        assert cached(long) == (total, total // 128 * 128)  # whole 128-token increments


def test_claude_codes_rotating_billing_header_is_not_prompt_to_the_vendor(
        client: anthropic.Anthropic, bank: WordBank) -> None:
    """The emulation assumes what Claude Code's users see at Anthropic: the header is request
    metadata, so a new suffix neither bills its tokens nor stops the read after it."""
    shared = {"type": "text", "text": bank.text(random.Random(12), 1200),
              "cache_control": EPHEMERAL}

    def system(suffix: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332."
                                         f"{suffix}; cc_entrypoint=cli;"}, shared]

    first = client.messages.create(model=SONNET, max_tokens=1, system=system("0b8"),
                                   messages=USER)
    second = client.messages.create(model=SONNET, max_tokens=1, system=system("b81"),
                                    messages=USER)
    plain = client.messages.count_tokens(model=SONNET, system=[shared], messages=USER)
    read, written, uncached = fields(second.usage)
    assert fields(first.usage)[1] == read > 1200 and written == 0
    assert read + uncached == plain.input_tokens
