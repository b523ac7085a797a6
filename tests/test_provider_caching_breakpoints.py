"""Anthropic's cache_control rules: limits, TTL order, empty blocks, automatic caching; errors
carry the vendor's status, type and message."""

from __future__ import annotations

import pytest

from radixserve.provider_caching import (
    CacheControlError,
    check_breakpoints,
    render_request,
    validate_breakpoints,
)

EPHEMERAL = {"type": "ephemeral"}


def text(value, **marker):
    block = {"type": "text", "text": value}
    if marker:
        block["cache_control"] = {"type": "ephemeral", **marker}
    return block


def body(system, messages=None, **extra):
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 8,
        "system": system,
        "messages": messages or [{"role": "user", "content": "hi"}],
        **extra,
    }


def error_of(request_body) -> CacheControlError:
    with pytest.raises(CacheControlError) as info:
        validate_breakpoints(render_request(request_body))
    return info.value


def test_breakpoints_come_in_cache_order_with_their_ttls():
    tools = [
        {"name": "a", "input_schema": {}},
        {"name": "b", "input_schema": {}, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    marks = validate_breakpoints(
        render_request(
            body(
                [text("sys", ttl="1h")],
                [{"role": "user", "content": [text("q", ttl="5m")]}],
                tools=tools,
            )
        )
    )
    assert [(m.path, m.ttl) for m in marks] == [
        ("tools.1", "1h"),
        ("system.0", "1h"),
        ("messages.0.content.0", "5m"),
    ]


def test_a_fifth_breakpoint_is_the_vendors_400():
    error = error_of(body([text(f"part {i}", ttl="5m") for i in range(5)]))
    assert error.status == 400 and error.error_type == "invalid_request_error"
    assert error.message == "A maximum of 4 blocks with cache_control may be provided. Found 5."
    assert error.to_anthropic() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error.message},
    }


def test_automatic_caching_uses_one_of_the_four_slots():
    four = [text(f"part {i}", ttl="5m") for i in range(4)]
    assert len(validate_breakpoints(render_request(body(four)))) == 4
    error = error_of(body(four, cache_control=EPHEMERAL))
    assert error.rule == "limit" and error.message.endswith("Found 5.")


def test_1h_after_5m_is_rejected_with_the_path_of_the_later_block():
    error = error_of(
        body(
            [text("a", ttl="5m"), text("b")],
            [{"role": "user", "content": [text("x"), text("y", ttl="1h")]}],
        )
    )
    assert error.rule == "ttl_order"
    assert error.message == (
        "messages.0.content.1.cache_control.ttl: a ttl='1h' cache_control block must not come "
        "after a ttl='5m' cache_control block. Note that blocks are processed in the following "
        "order: `tools`, `system`, `messages`."
    )


def test_a_marker_without_ttl_counts_as_5m():
    error = error_of(
        body([text("a", ttl=None) | {"cache_control": EPHEMERAL}, text("b", ttl="1h")])
    )
    assert error.rule == "ttl_order"


def test_no_marker_on_an_empty_text_block():
    error = error_of(body("s", [{"role": "user", "content": [text("q"), text("", ttl="5m")]}]))
    assert (
        error.message
        == "messages.0.content.1.text: cache_control cannot be set for empty text blocks"
    )


@pytest.mark.parametrize(
    "marker, rule",
    [({"type": "persistent"}, "type"), ({"type": "ephemeral", "ttl": "10m"}, "ttl_value")],
)
def test_marker_values_are_validated(marker, rule):
    error = error_of(body([{"type": "text", "text": "x", "cache_control": marker}]))
    assert error.rule == rule and error.message.startswith("system.0.cache_control.")


def test_thinking_blocks_cannot_carry_markers():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "thinking",
                    "thinking": "hmm",
                    "signature": "s",
                    "cache_control": EPHEMERAL,
                }
            ],
        },
    ]
    assert error_of(body("s", messages)).rule == "thinking"


def test_inner_tool_result_markers_other_than_the_last_are_rejected():
    result = {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [text("a", ttl="5m"), text("b")],
    }
    error = error_of(body("s", [{"role": "user", "content": [result]}]))
    assert error.rule == "inner_block" and error.message.startswith(
        "messages.0.content.0.content.0"
    )


def test_automatic_marker_lands_on_the_last_eligible_block():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "thinking", "thinking": "t", "signature": "s"},
            ],
        },
    ]
    marks = validate_breakpoints(render_request(body("s", messages, cache_control=EPHEMERAL)))
    assert [(m.path, m.automatic) for m in marks] == [("messages.1.content.0", True)]


def test_automatic_marker_on_an_already_marked_block():
    same = body("s", [{"role": "user", "content": [text("q", ttl="5m")]}], cache_control=EPHEMERAL)
    assert len(validate_breakpoints(render_request(same))) == 1  # same TTL: a no-op
    other = body(
        "s",
        [{"role": "user", "content": [text("q", ttl="5m")]}],
        cache_control={"type": "ephemeral", "ttl": "1h"},
    )
    assert error_of(other).rule == "automatic_ttl"


def test_no_eligible_block_skips_automatic_caching():
    request = render_request(
        {
            "max_tokens": 1,
            "messages": [{"role": "user", "content": [text("")]}],
            "cache_control": EPHEMERAL,
        },
        "anthropic",
    )
    assert validate_breakpoints(request) == ()


def test_check_collects_every_error_and_openai_bodies_have_no_breakpoints():
    check = check_breakpoints(
        render_request(body([text(str(i), ttl="1h" if i == 4 else "5m") for i in range(5)]))
    )
    assert {e.rule for e in check.errors} == {"limit", "ttl_order"}
    openai = render_request({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    assert check_breakpoints(openai).breakpoints == ()
