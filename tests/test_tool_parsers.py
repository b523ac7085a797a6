"""Tool-call parsing per chat-template family, on recorded model-style replies: calls, parallel
calls, text around calls, nested and unicode arguments, malformed and unterminated calls kept as
content; and streaming, where any chunking of a reply adds up to the parse of the whole reply."""

from __future__ import annotations

import json
import random

import pytest

from radixserve.server.tool_parsers import (
    PARSERS,
    ParsedOutput,
    StreamUpdate,
    ToolCall,
    ToolCallStream,
    family_for_template,
    parse_tool_calls,
)

WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", '{"zone": "Europe/Paris"}')
NESTED_ARGS = {"city": "Zürich", "filters": {"tags": ["☀️", "雨"], "days": 3, "exact": True},
               "note": "say \"hi\"\n"}
NESTED = ToolCall("search", json.dumps(NESTED_ARGS, ensure_ascii=False))
NESTED_JSON = json.dumps(NESTED_ARGS, ensure_ascii=False, indent=1)

# family -> [(reply as a model writes it, expected parse)]
CASES: dict[str, list[tuple[str, ParsedOutput]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         ParsedOutput("", [WEATHER])),
        # Parallel calls, and the arguments-first key order of radixserve's fallback prompt.
        ('<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
         ParsedOutput("", [WEATHER, TIME])),
        ('Let me check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris"}}\n</tool_call>',
         ParsedOutput("Let me check the weather.", [WEATHER])),
        ('First: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
         ' then: <tool_call>{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}'
         '</tool_call> done.',
         ParsedOutput("First:  then:  done.", [WEATHER, TIME])),
        (f'<tool_call>\n{{"name": "search", "arguments": {NESTED_JSON}}}\n</tool_call>',
         ParsedOutput("", [NESTED])),
        # Arguments as a JSON string, and a call without arguments.
        ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
         '</tool_call><tool_call>{"name": "now"}</tool_call>',
         ParsedOutput("", [WEATHER, ToolCall("now", "{}")])),
        # The SmolLM2 list inside hermes tags.
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]</tool_call>',
         ParsedOutput("", [WEATHER, TIME])),
        # A malformed block stays content as written; the good call after it still counts.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}</tool_call>',
         ParsedOutput('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n'
                      '</tool_call>', [TIME])),
        ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
         ParsedOutput('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
                      [])),
        ("The weather in Paris is sunny, 21 °C.",
         ParsedOutput("The weather in Paris is sunny, 21 °C.", [])),
        ("Use a <tool_ tag? No: <tool", ParsedOutput("Use a <tool_ tag? No: <tool", [])),
    ],
    "smollm2": [
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
         ParsedOutput("", [WEATHER])),
        ('<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
         '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n]</tool_call>',
         ParsedOutput("", [WEATHER, TIME])),
        ('Sure.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
         '</tool_call>', ParsedOutput("Sure.", [WEATHER])),
        (f'<tool_call>[{{"name": "search", "arguments": {NESTED_JSON}}}]</tool_call>',
         ParsedOutput("", [NESTED])),
        # SmolLM2's prompt asks for an empty list when no call is needed.
        ("<tool_call>[]</tool_call>", ParsedOutput("", [])),
        # One bad element makes the whole block content.
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"arguments": {}}]</tool_call>',
         ParsedOutput('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                      '{"arguments": {}}]</tool_call>', [])),
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}',
         ParsedOutput('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}',
                      [])),
        ("I cannot help with that.", ParsedOutput("I cannot help with that.", [])),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
         ParsedOutput("", [WEATHER])),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
         ParsedOutput("", [WEATHER])),
        ('\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}',
         ParsedOutput("", [WEATHER, TIME])),
        (f'{{"name": "search", "parameters": {NESTED_JSON}}}', ParsedOutput("", [NESTED])),
        # Text after the calls is content.
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}\nI asked for the weather.',
         ParsedOutput("I asked for the weather.", [WEATHER])),
        # A reply that does not start with a call is all content, JSON included.
        ('Here it is: {"name": "get_weather", "parameters": {"city": "Paris"}}',
         ParsedOutput('Here it is: {"name": "get_weather", "parameters": {"city": "Paris"}}',
                      [])),
        ('{"name": "get_weather", "parameters": {"city": Paris}}',
         ParsedOutput('{"name": "get_weather", "parameters": {"city": Paris}}', [])),
        ('{"name": "get_weather", "parameters": {"city": "Par',
         ParsedOutput('{"name": "get_weather", "parameters": {"city": "Par', [])),
        ('{"answer": 42}', ParsedOutput('{"answer": 42}', [])),
        ('<|python_tag|>brave_search.call(query="weather Paris")',
         ParsedOutput('<|python_tag|>brave_search.call(query="weather Paris")', [])),
        ("The weather in Paris is sunny.", ParsedOutput("The weather in Paris is sunny.", [])),
    ],
}
ALL_CASES = [(family, text, parsed) for family, cases in CASES.items()
             for text, parsed in cases]


@pytest.mark.parametrize(("family", "text", "parsed"), ALL_CASES)
def test_parse(family: str, text: str, parsed: ParsedOutput) -> None:
    assert parse_tool_calls(text, family) == parsed


@pytest.mark.parametrize("call", [
    '{"arguments": {"city": "Paris"}}',  # no name
    '{"name": 7, "arguments": {}}',
    '{"name": "", "arguments": {}}',
    '{"name": "get_weather", "arguments": ["Paris"]}',
    '{"name": "get_weather", "arguments": "Paris"}',  # a string, but not an object's JSON
    '{"name": "get_weather", "arguments": {"t": NaN}}',  # Python's extension, not JSON
    '{"name": "get_weather", "arguments": {"s": "\\ud800"}}',  # lone surrogate: not UTF-8
    '"get_weather"',
])
@pytest.mark.parametrize("family", ["hermes", "smollm2"])
def test_malformed_calls_stay_content(family: str, call: str) -> None:
    text = f"Before <tool_call>{call}</tool_call>"
    assert parse_tool_calls(text, family) == ParsedOutput(text, [])


def test_llama3_malformed_call_stays_content() -> None:
    for call in ['{"parameters": {}}', '{"name": "f", "parameters": 3}', '{"name": ["f"]}']:
        assert parse_tool_calls(call, "llama3_json") == ParsedOutput(call, [])
    # After a good call, only the bad remainder is content (its separator dropped).
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": 1}'
    assert parse_tool_calls(text, "llama3_json") == ParsedOutput('{"name": 1}', [WEATHER])


def test_arguments_keep_the_models_key_order() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"b": 1, "a": {"d": 2, "c": 3}}}</tool_call>'
    assert parse_tool_calls(text, "hermes").calls[0].arguments == '{"b": 1, "a": {"d": 2, "c": 3}}'


def test_unknown_family_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes, smollm2, llama3_json"):
        parse_tool_calls("hi", "mistral")
    with pytest.raises(ValueError, match="hermes, smollm2, llama3_json"):
        ToolCallStream("mistral")
    assert PARSERS == ("hermes", "smollm2", "llama3_json")


@pytest.mark.parametrize(("template", "family"), [
    (None, "hermes"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
     "hermes"),
    ('{%- if tools %}...<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
     "\\n</tool_call>{%- endif %}", "hermes"),
    ("...put it in the format of <tool_call>[{\"name\": \"func_name1\", ...}]</tool_call>",
     "smollm2"),
    ("{%- if message.role == \"ipython\" %}<|start_header_id|>ipython<|end_header_id|>",
     "llama3_json"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
])
def test_family_for_template(template: str | None, family: str) -> None:
    assert family_for_template(template) == family


def stream_in_chunks(text: str, family: str, rng: random.Random) -> list[StreamUpdate]:
    stream = ToolCallStream(family)
    updates = []
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 7))
        updates.append(stream.feed(text[:end], final=False))
    updates.append(stream.feed(text, final=True))
    return updates


def reassemble(updates: list[StreamUpdate]) -> ParsedOutput:
    """The parse a client would rebuild from the stream, checking OpenAI's delta rules."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for update in updates:
        for delta in update.calls:
            if delta.index not in names:
                assert delta.index == len(names), "calls are numbered in order"
                assert delta.name is not None, "a call's first delta carries its name"
                names[delta.index] = delta.name
                arguments[delta.index] = ""
            else:
                assert delta.name is None
            arguments[delta.index] += delta.arguments
    content = "".join(update.content for update in updates)
    return ParsedOutput(content, [ToolCall(names[i], arguments[i]) for i in range(len(names))])


@pytest.mark.parametrize(("family", "text", "parsed"), ALL_CASES)
def test_any_chunking_streams_the_parse(family: str, text: str, parsed: ParsedOutput) -> None:
    for seed in range(5):
        assert reassemble(stream_in_chunks(text, family, random.Random(seed))) == parsed


# Pieces that meet each family's edge cases when glued in random order.
FRAGMENTS = ["Hi", " ", "\n", ";", "{", "}", "[", "]", '"', "<tool_call>", "</tool_call>",
             "<tool_", "<|python_tag|>", "<|pyth", '{"name": "f", "arguments": {"a": 1}}',
             '{"name": "g", "parameters": {"b": [2, "☃"]}}', '"name": "h"', "[]", "null",
             '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
             '<tool_call>\n[{"name": "g", "arguments": "{}"}, {"name": "h"}]\n</tool_call>']


@pytest.mark.parametrize("family", PARSERS)
def test_random_replies_stream_their_parse(family: str) -> None:
    rng = random.Random(family)
    with_calls = 0
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        parsed = parse_tool_calls(text, family)
        assert reassemble(stream_in_chunks(text, family, rng)) == parsed, text
        with_calls += bool(parsed.calls)
    assert with_calls > 15, "the fragments should make calls often enough to test them"


def test_a_partial_tag_is_held_back() -> None:
    stream = ToolCallStream("hermes")
    assert stream.feed("Sure <tool_", final=False) == StreamUpdate("Sure", [])
    update = stream.feed('Sure <tool_call>{"name": "get_weather", "arguments": {"city": '
                         '"Paris"}}</tool_call>', final=False)
    assert update.content == ""
    assert [(d.index, d.name, d.arguments) for d in update.calls] == [
        (0, "get_weather", '{"city": "Paris"}')]

    stream = ToolCallStream("hermes")
    assert stream.feed("Sure <tool_", final=False) == StreamUpdate("Sure", [])
    assert stream.feed("Sure <tool_", final=True) == StreamUpdate(" <tool_", [])


def test_calls_stream_before_the_reply_ends() -> None:
    stream = ToolCallStream("hermes")
    assert stream.feed("<tool_call>\n{", final=False) == StreamUpdate("", [])
    update = stream.feed('<tool_call>\n{"name": "now"}\n</tool_call>\n', final=False)
    assert update.calls[0].name == "now"

    stream = ToolCallStream("llama3_json")
    assert stream.feed('<|python_tag|>{"name": "now", "parameters": {', final=False).calls == []
    update = stream.feed('<|python_tag|>{"name": "now", "parameters": {}}', final=False)
    assert update.calls[0].name == "now"
    assert stream.feed('<|python_tag|>{"name": "now", "parameters": {}}', final=True) == \
        StreamUpdate("", [])


def test_llama3_prose_streams_at_once() -> None:
    stream = ToolCallStream("llama3_json")
    assert stream.feed("  <|py", final=False) == StreamUpdate("", [])
    assert stream.feed("  <|pyx The", final=False) == StreamUpdate("<|pyx The", [])


def test_misuse_of_a_stream_raises() -> None:
    stream = ToolCallStream("hermes")
    stream.feed("Hello there", final=False)
    with pytest.raises(ValueError, match="extend"):
        stream.feed("Hello", final=False)
    stream.feed("Hello there", final=True)
    with pytest.raises(ValueError, match="final"):
        stream.feed("Hello there", final=True)
