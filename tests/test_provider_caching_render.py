"""Cache blocks from request bodies, format detection, and breakpoint token offsets in the
model's chat template (with a character tokenizer, and with the default model's)."""

from __future__ import annotations

import pytest

from radixserve.provider_caching import (
    BodyError,
    VendorCache,
    breakpoint_token_offsets,
    chat_prompt,
    detect_format,
    get_profile,
    render_prompt,
    render_request,
    validate_breakpoints,
)
from radixserve.provider_caching.layout import build_layout, prefix_hashes
from radixserve.provider_caching.render import block_end_offsets, block_token_counts

pytestmark = [pytest.mark.model]

TOOL = {
    "name": "get_weather",
    "description": "Weather.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def anthropic_body(**extra):
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "tools": [TOOL],
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"z": 1, "a": 2},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": "sunny"},
                            {"type": "text", "text": "18C", "cache_control": {"type": "ephemeral"}},
                        ],
                    }
                ],
            },
        ],
    }
    return body | extra


class CharTokenizer:
    """One token per character, and a tiny chat template: offsets are character counts."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_anthropic_blocks_follow_cache_order_with_paths_and_markers():
    request = render_request(anthropic_body())
    assert request.format == "anthropic"
    assert [(b.tier, b.path, b.kind) for b in request.blocks] == [
        ("tools", "tools.0", "tool"),
        ("system", "system.0", "text"),
        ("messages", "messages.0.content", "text"),
        ("messages", "messages.1.content.0", "tool_use"),
        ("messages", "messages.2.content.0", "tool_result"),
    ]
    # The marker on the last inner tool_result block is hoisted onto the tool_result.
    assert request.blocks[4].cache_control is not None
    assert "sunny\n18C" in request.blocks[4].text


def test_tool_inputs_and_schemas_serialise_with_sorted_keys_unless_asked_not_to():
    sorted_ = render_request(anthropic_body())
    assert sorted_.blocks[3].text.endswith('{"a": 2, "z": 1}')
    assert sorted_.blocks[0].text.index('"description"') < sorted_.blocks[0].text.index('"name"')
    as_sent = render_request(anthropic_body(), sort_keys=False)
    assert as_sent.blocks[3].text.endswith('{"z": 1, "a": 2}')


def test_openai_body_blocks_and_settings():
    body = {
        "model": "gpt-4o",
        "reasoning_effort": "low",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'},
                    }
                ],
            },
        ],
    }
    request = render_request(body)
    assert request.format == "openai"
    assert [(b.tier, b.path) for b in request.blocks] == [
        ("tools", "tools.0"),
        ("system", "messages.0.content"),
        ("messages", "messages.1.content.0"),
        ("messages", "messages.2.tool_calls.0"),
    ]
    assert request.blocks[3].text.endswith('{"a": 2, "b": 1}')
    assert [(s.name, s.invalidates) for s in request.settings] == [("reasoning_effort", "tools")]


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"messages": [], "system": "x"}, "anthropic"),
        ({"messages": [{"role": "system", "content": "x"}]}, "openai"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "openai",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
                ]
            },
            "anthropic",
        ),
        (
            {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}]},
            "anthropic",
        ),
        (
            {"model": "gpt-4o", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            "openai",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, "anthropic"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "openai"),
        ({"tools": [{"name": "f", "input_schema": {}}], "messages": []}, "anthropic"),
    ],
)
def test_detect_format(body, expected):
    assert detect_format(body) == expected


@pytest.mark.parametrize("body", [[], {"prompt": "x"}, {"messages": "x"}])
def test_detect_format_rejects_non_chat_bodies(body):
    with pytest.raises(BodyError):
        detect_format(body)


def test_malformed_bodies_name_the_field():
    with pytest.raises(BodyError, match=r"messages\.0\.role"):
        render_request({"messages": [{"content": "x"}], "system": "s"})
    with pytest.raises(BodyError, match=r"system"):
        render_request({"messages": [], "system": 7, "max_tokens": 1}, "anthropic")


def test_settings_change_hashes_from_the_tier_they_invalidate():
    base = render_request(anthropic_body())
    changed = render_request(anthropic_body(tool_choice={"type": "any"}))
    a, b = prefix_hashes(base), prefix_hashes(changed)
    assert a[:2] == b[:2]  # tools and system survive a tool_choice change
    assert a[2] != b[2]  # the messages tier does not
    assert prefix_hashes(base, namespace="other-model")[0] != a[0]


@pytest.mark.parametrize("setting", [
    {"output_config": {"effort": "low"}},
    {"thinking": {"type": "enabled", "budget_tokens": 2048}},
])
def test_an_effort_or_thinking_change_prices_the_messages_as_a_miss(setting):
    """Anthropic's invalidation table: thinking and effort changes break the messages cache
    but keep tools and system."""
    a = prefix_hashes(render_request(anthropic_body()))
    b = prefix_hashes(render_request(anthropic_body(**setting)))
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_a_reasoning_effort_change_is_a_whole_prefix_miss_on_openai():
    """An open-weight template writes the effort at the head of the prompt (gpt-oss's
    `Reasoning: high`): the emulation prices a change as a miss from the first token, even
    where the same token ids came out of this model's template, and the same effort as a
    hit."""
    def usage(cache, effort):
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"reasoning_effort": effort}}
        request = render_request(body, "openai")
        assert [(s.name, s.invalidates) for s in request.settings] == [
            ("chat_template_kwargs.reasoning_effort", "tools")]
        ids = list(range(3000))  # the same rendered prompt either way
        accounting = cache.start(build_layout(request, [], [], len(ids), token_ids=ids))
        cache.first_token(accounting.request_id)
        return accounting.usage.cache_read_tokens

    cache = VendorCache(get_profile("openai"), lambda: 0.0)
    assert usage(cache, "low") == 0
    assert usage(cache, "low") == 2944  # whole 128-token increments of the same prompt
    assert usage(cache, "high") == 0


def test_breakpoint_offsets_in_a_character_template_end_after_the_block():
    tokenizer = CharTokenizer()
    request = render_request(anthropic_body())
    marks = validate_breakpoints(request)
    prompt = chat_prompt(request)
    rendered = render_prompt(tokenizer, prompt)
    offsets = breakpoint_token_offsets(tokenizer, prompt, [m.block_index for m in marks], rendered)
    system_end = rendered.text.index("You are terse.") + len("You are terse.")
    # A block that ends its message takes the message's closing tag with it.
    assert offsets[0] == system_end + len("</>")
    tool_result_end = rendered.text.index("18C") + len("18C")
    assert offsets[1] == tool_result_end + len("</>")
    assert offsets == sorted(offsets) and offsets[-1] < len(rendered.token_ids)


def test_blockwise_counts_and_offsets():
    request = render_request(anthropic_body())
    counts = block_token_counts(request, CharTokenizer())
    assert counts == [len(b.text) for b in request.blocks]
    assert block_end_offsets(counts)[-1] == sum(counts)


def test_breakpoint_offsets_with_the_default_models_template(tokenizer):
    request = render_request(anthropic_body())
    marks = validate_breakpoints(request)
    prompt = chat_prompt(request)
    rendered = render_prompt(tokenizer, prompt)
    assert rendered.token_ids == tokenizer.encode_chat(prompt.chat_messages())
    offsets = breakpoint_token_offsets(tokenizer, prompt, [m.block_index for m in marks], rendered)
    for offset, marker_text in zip(offsets, ["You are terse.", "18C"], strict=True):
        head = tokenizer.decode(rendered.token_ids[:offset], skip_special_tokens=False)
        assert head.rstrip().endswith(marker_text + "<|im_end|>")
        assert rendered.text.startswith(head)
    # The tools section sits in front of the system prompt, in cache order.
    assert rendered.text.index('"get_weather"') < rendered.text.index("You are terse.")
