"""Per-request preambles taken out of request bodies (provider_caching.preambles): each form
Claude Code and the proxies in front of it send, what stays untouched, the operator's own
patterns, and the settings that govern the strip."""

from __future__ import annotations

import pytest

from radixserve.provider_caching.preambles import KNOWN_PREAMBLES, preamble_table, strip_preambles
from radixserve.server.settings import ServerSettings

HEADER = "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli;"
MARK = {"type": "ephemeral"}


def test_a_block_holding_only_the_header_goes_whole_and_the_next_keeps_its_breakpoint() -> None:
    body = {"system": [{"type": "text", "text": HEADER},
                       {"type": "text", "text": "You are an agent.", "cache_control": MARK}],
            "messages": []}
    out, stripped = strip_preambles(body, "anthropic", KNOWN_PREAMBLES)
    assert out["system"] == [{"type": "text", "text": "You are an agent.", "cache_control": MARK}]
    assert [(s.name, s.path, s.text) for s in stripped] == [
        ("claude_code_billing_header", "system.0", HEADER)]
    assert len(body["system"]) == 2  # the caller's body is not changed


@pytest.mark.parametrize(("system", "left"), [
    (f"{HEADER}\nYou are an agent.", "You are an agent."),
    (f"  {HEADER}\n\nYou are an agent.", "You are an agent."),
    ([{"type": "text", "text": f"{HEADER}\nYou are an agent.", "cache_control": MARK}],
     [{"type": "text", "text": "You are an agent.", "cache_control": MARK}]),
])
def test_the_header_line_leaves_the_rest_of_its_text(system: object, left: object) -> None:
    out, stripped = strip_preambles({"system": system, "messages": []}, "anthropic",
                                    KNOWN_PREAMBLES)
    assert out["system"] == left and stripped[0].text == HEADER


def test_a_system_of_only_the_header_goes() -> None:
    out, _ = strip_preambles({"system": HEADER, "messages": []}, "anthropic", KNOWN_PREAMBLES)
    assert "system" not in out


@pytest.mark.parametrize("system", [
    f"You are an agent.\n{HEADER}",  # not at the head: it is prompt
    [{"type": "text", "text": "You are an agent."}, {"type": "text", "text": HEADER}],
    "x-anthropic-billing-headers are discussed here.",
])
def test_text_elsewhere_is_prompt(system: object) -> None:
    body = {"system": system, "messages": []}
    assert strip_preambles(body, "anthropic", KNOWN_PREAMBLES) == (body, [])


@pytest.mark.parametrize(("content", "left"), [
    (f"{HEADER}\nYou are an agent.", "You are an agent."),
    ([{"type": "text", "text": HEADER}, {"type": "text", "text": "You are an agent."}],
     [{"type": "text", "text": "You are an agent."}]),
])
def test_the_openai_route_strips_what_proxies_put_in_the_system_message(
        content: object, left: object) -> None:
    body = {"messages": [{"role": "system", "content": content},
                         {"role": "user", "content": "hi"}]}
    out, stripped = strip_preambles(body, "openai", KNOWN_PREAMBLES)
    assert out["messages"] == [{"role": "system", "content": left},
                               {"role": "user", "content": "hi"}]
    assert stripped[0].path.startswith("messages.0.content")


def test_a_system_message_of_only_the_header_goes_and_a_user_message_is_left_alone() -> None:
    body = {"messages": [{"role": "system", "content": HEADER}, {"role": "user", "content": "x"}]}
    out, _ = strip_preambles(body, "openai", KNOWN_PREAMBLES)
    assert out["messages"] == [{"role": "user", "content": "x"}]
    user_first = {"messages": [{"role": "user", "content": HEADER}]}
    assert strip_preambles(user_first, "openai", KNOWN_PREAMBLES) == (user_first, [])


def test_operator_patterns_and_the_off_switch() -> None:
    table = preamble_table([r"request-id: \w+"])
    out, stripped = strip_preambles({"system": "request-id: a1\nHi.", "messages": []},
                                    "anthropic", table)
    assert out["system"] == "Hi." and stripped[0].name == "custom_0"
    assert ServerSettings(strip_preambles=False).preambles == ()
    assert ServerSettings(preamble_patterns=("x:",)).preambles[-1].pattern.pattern == "x:"
    with pytest.raises(ValueError, match="preamble pattern"):
        ServerSettings(preamble_patterns=("(",))


def test_vendor_accounting_keeps_the_strip_on() -> None:
    with pytest.raises(ValueError, match="vendor cache accounting needs strip_preambles"):
        ServerSettings(cache_accounting="vendor", strip_preambles=False)
    with pytest.raises(ValueError, match="max_tokens_policy"):
        ServerSettings(max_tokens_policy="shrink")
