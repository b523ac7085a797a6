"""Tool-call parsing per chat-template family, on recorded model-style replies: calls, parallel
calls, text around calls, nested and unicode arguments passed on as the model wrote them,
malformed and unterminated calls kept as content; and streaming, whole calls or arguments as
they are generated, where any chunking of a reply adds up to the parse of the whole reply."""

from __future__ import annotations

import json
import random
import re

import pytest

from radixserve.server.tool_calls.parsers import (
    PARSERS,
    ParsedOutput,
    StreamUpdate,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    family_for_template,
    parse_tool_calls,
)
from radixserve.server.tool_calls.tools import CallReading

WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", '{"zone": "Europe/Paris"}')
NESTED_ARGS = {"city": "Zürich", "filters": {"tags": ["☀️", "雨"], "days": 3, "exact": True},
               "note": "say \"hi\"\n"}
NESTED_JSON = json.dumps(NESTED_ARGS, ensure_ascii=False, indent=1)
NESTED = ToolCall("search", NESTED_JSON)  # the arguments' text as written, indentation and all

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


def test_arguments_are_the_models_text() -> None:
    # Key order, spacing, escapes and number spellings as written; only the whitespace around
    # the value goes.
    written = '{ "b":1.50, "a": {"d" :2,"c":3}, "e":"\\u00e9\\n" }'
    text = f'<tool_call>{{"name": "f", "arguments":  {written}\n}}</tool_call>'
    assert parse_tool_calls(text, "hermes").calls == [ToolCall("f", written)]
    # Arguments written as a JSON string holding an object: that object, re-encoded.
    text = '{"name": "f", "parameters": "{ \\"a\\" : \\"\\u00e9\\" }"}'
    assert parse_tool_calls(text, "llama3_json").calls == [ToolCall("f", '{"a": "é"}')]
    text = '<tool_call>{"name": "f", "arguments": null}</tool_call>'
    assert parse_tool_calls(text, "hermes").calls == [ToolCall("f", "{}")]


@pytest.mark.parametrize("call", [
    '{"name": "f", "name": "g", "arguments": {}}',
    '{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}',
    '{"name": "f", "arguments": {}, "parameters": {}}',
])
def test_ambiguous_calls_stay_content(call: str) -> None:
    # Which key counts is not clear, and a stream may have sent the first one already.
    text = f"<tool_call>{call}</tool_call>"
    assert parse_tool_calls(text, "hermes") == ParsedOutput(text, [])
    assert parse_tool_calls(call, "llama3_json") == ParsedOutput(call, [])


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


def stream_in_chunks(text: str, family: str, rng: random.Random,
                     incremental: bool = False) -> list[StreamUpdate]:
    stream = ToolCallStream(family, incremental)
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


# ----- incremental streams: a call's arguments as they are generated -----

# Arguments whose text tries the scanner: brackets and quotes inside strings, escapes, nesting.
ARGUMENT_VALUES: list[dict[str, object]] = [
    {}, {"city": "Paris"}, {"q": "} ] { [ \\", "n": -1500.0}, {"s": 'say "hi" \\\\', "t": '"} ]'},
    NESTED_ARGS, {"deep": [[{"x": None}], {"y": [True, False]}], "z": "\\u00e9"}]


def random_call(rng: random.Random) -> tuple[str, ToolCall]:
    """A well-formed call object in a random shape and spacing, and the call it stands for."""
    name = rng.choice(["get_weather", "f", "say_héllo"])
    arguments = rng.choice(ARGUMENT_VALUES)
    form = rng.choice(["object", "object", "object", "string", "null", "missing"])
    style = rng.choice([{"separators": (",", ":")}, {}, {"indent": 1}])
    written = json.dumps(arguments, ensure_ascii=rng.random() < 0.5, **style)  # type: ignore[arg-type]
    expected = written
    if form == "string":
        written, expected = json.dumps(written), json.dumps(arguments, ensure_ascii=False)
    elif form in ("null", "missing"):
        written, expected = "null", "{}"
    members = [f'"name":{rng.choice(["", " "])}{json.dumps(name)}']
    if form != "missing":
        key = rng.choice(["arguments", "parameters"])
        members.insert(rng.choice([0, 1]), f'"{key}": {written}')  # name first, or not
    if rng.random() < 0.2:
        members.append('"id": 7')
    separator = rng.choice([",", ", ", ",\n "])
    return "{" + separator.join(members) + rng.choice(["}", "\n}"]), ToolCall(name, expected)


def random_reply(family: str, rng: random.Random) -> tuple[str, list[ToolCall]]:
    """A reply of text and well-formed calls in `family`'s format, and its calls."""
    calls: list[ToolCall] = []

    def call_texts(count: int) -> list[str]:
        made = [random_call(rng) for _ in range(count)]
        calls.extend(call for _, call in made)
        return [text for text, _ in made]

    if family == "llama3_json":
        head = rng.choice(["", "\n", "<|python_tag|>"])
        text = head + rng.choice(["; ", ";", "\n"]).join(call_texts(rng.randint(1, 3)))
        return text + rng.choice(["", "\nI asked for the weather."]), calls
    parts = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.4:
            parts.append(rng.choice(["Sure. ", "{not a call} ", "\n", "[1, 2] "]))
        elif family == "smollm2" or rng.random() < 0.2:
            parts.append(f"<tool_call>[{', '.join(call_texts(rng.randint(1, 2)))}]</tool_call>")
        else:
            parts.append(f"<tool_call>{rng.choice(['', chr(10)])}{call_texts(1)[0]}\n</tool_call>")
    return "".join(parts), calls


@pytest.mark.parametrize("family", PARSERS)
def test_incremental_streams_add_up_to_the_parse(family: str) -> None:
    rng = random.Random(f"incremental {family}")
    in_pieces = 0
    for _ in range(200):
        text, calls = random_reply(family, rng)
        parsed = parse_tool_calls(text, family)
        assert parsed.calls == calls, text
        updates = stream_in_chunks(text, family, rng, incremental=True)
        assert reassemble(updates) == parsed, text
        deltas = [delta.index for update in updates for delta in update.calls]
        in_pieces += sum(deltas.count(index) > 1 for index in set(deltas))
    assert in_pieces > 40, "name-first calls should often stream in several deltas"


# An incremental stream announces a call like this before it is complete; if it then turns out
# malformed or cut off, its deltas stay while parse_tool_calls keeps its text as content.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"(arguments|parameters)"\s*:\s*\{')
WHOLE_CASES = [case for case in ALL_CASES if not _CALL_HEAD.search(case[2].content)]


@pytest.mark.parametrize(("family", "text", "parsed"), WHOLE_CASES)
def test_incremental_chunking_streams_the_parse(family: str, text: str,
                                               parsed: ParsedOutput) -> None:
    for seed in range(5):
        updates = stream_in_chunks(text, family, random.Random(seed), incremental=True)
        assert reassemble(updates) == parsed


@pytest.mark.parametrize("family", PARSERS)
def test_incremental_random_replies_follow_the_delta_rules(family: str) -> None:
    # Garbage included: the stream never raises, numbers calls in order, names each call in
    # its first delta (reassemble checks), and adds up to the parse unless it lost a call.
    rng = random.Random(f"fragments {family}")
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        parsed = parse_tool_calls(text, family)
        streamed = reassemble(stream_in_chunks(text, family, rng, incremental=True))
        if not _CALL_HEAD.search(parsed.content):
            assert streamed == parsed, text


def test_incremental_announces_a_call_before_its_arguments_end() -> None:
    text = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    stream = ToolCallStream("hermes", incremental=True)
    begun = text.index("{", 12)  # where the arguments object begins
    assert stream.feed(text[:begun], final=False) == StreamUpdate("", [])
    assert stream.feed(text[:begun + 9], final=False) == StreamUpdate(
        "", [ToolCallDelta(0, "get_weather", '{"city":"')])
    # Never past the object's end, though the text goes on.
    assert stream.feed(text[:-3], final=False) == StreamUpdate(
        "", [ToolCallDelta(0, None, 'Paris"}')])
    assert stream.feed(text, final=True) == StreamUpdate("", [])


@pytest.mark.parametrize(("family", "text"), [
    ("hermes", '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>\n'
               '<tool_call>{"name":"add","arguments":{"a":1,"b":{"c":"\\"}"}}}</tool_call>'),
    ("smollm2", '<tool_call>[{"name":"get_weather","arguments":{"city":"Paris"}},'
                '{"name":"add","arguments":{"a":1,"b":{"c":"\\"}"}}}]</tool_call>'),
    ("llama3_json", '{"name":"get_weather","parameters":{"city":"Paris"}};'
                    '{"name":"add","parameters":{"a":1,"b":{"c":"\\"}"}}}'),
])
def test_forced_call_shapes_stream_token_by_token(family: str, text: str) -> None:
    # What a forced call's grammar writes, fed a character at a time.
    stream = ToolCallStream(family, incremental=True)
    updates = [stream.feed(text[:end], final=end == len(text)) for end in range(1, len(text) + 1)]
    parsed = parse_tool_calls(text, family)
    assert reassemble(updates) == parsed and len(parsed.calls) == 2
    for index, call in enumerate(parsed.calls):
        deltas = [d for update in updates for d in update.calls if d.index == index]
        assert deltas[0] == ToolCallDelta(index, call.name, "{")
        assert len(deltas) == len(call.arguments)


def test_incremental_name_after_the_arguments_streams_the_call_whole() -> None:
    for call, arguments in (('{"arguments":{"city":"Paris"},"name":"get_weather"}',
                             '{"city":"Paris"}'),
                            ('{"name":"get_weather","arguments":"{\\"city\\":\\"Paris\\"}"}',
                             '{"city": "Paris"}')):  # a string: known once decoded
        text = f"<tool_call>{call}</tool_call>"
        stream = ToolCallStream("hermes", incremental=True)
        for end in range(1, len(text)):
            assert stream.feed(text[:end], final=False) == StreamUpdate("", [])
        assert stream.feed(text, final=True) == StreamUpdate(
            "", [ToolCallDelta(0, "get_weather", arguments)])


def test_incremental_call_cut_off_is_not_taken_back() -> None:
    text = 'Sure. <tool_call>{"name":"get_weather","arguments":{"city":"Pa'
    stream = ToolCallStream("hermes", incremental=True)
    assert stream.feed(text[:-1], final=False) == StreamUpdate(
        "Sure.", [ToolCallDelta(0, "get_weather", '{"city":"P')])
    # The last token still reaches the partial call, and its text is not also content...
    assert stream.feed(text, final=True) == StreamUpdate("", [ToolCallDelta(0, None, "a")])
    # ...while the parse of the whole reply keeps the unterminated call as content.
    assert parse_tool_calls(text, "hermes") == ParsedOutput(text, [])

    text = '<|python_tag|>{"name":"get_weather","parameters":{"city":"Pa'
    stream = ToolCallStream("llama3_json", incremental=True)
    assert stream.feed(text[:-6], final=False).calls == [ToolCallDelta(0, "get_weather", '{"cit')]
    assert stream.feed(text, final=True) == StreamUpdate("", [ToolCallDelta(0, None, 'y":"Pa')])


def test_incremental_malformed_call_keeps_its_index() -> None:
    text = ('<tool_call>{"name":"f","arguments":{"a":1}} oops</tool_call> Then '
            '<tool_call>{"name":"g","arguments":{}}</tool_call>')
    stream = ToolCallStream("hermes", incremental=True)
    updates = [stream.feed(text[:end], final=end == len(text)) for end in range(1, len(text) + 1)]
    assert reassemble(updates) == ParsedOutput("Then", [ToolCall("f", '{"a":1}'),
                                                        ToolCall("g", "{}")])
    assert parse_tool_calls(text, "hermes") == ParsedOutput(
        '<tool_call>{"name":"f","arguments":{"a":1}} oops</tool_call> Then', [ToolCall("g", "{}")])


def test_calls_the_check_refuses_stay_content_parsed_and_streamed() -> None:
    text = ('A <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> B '
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    only_f = lambda call: call.name == "f"  # noqa: E731
    parsed = parse_tool_calls(text, "hermes", only_f)
    assert [c.name for c in parsed.calls] == ["f"]
    assert parsed.content == 'A  B <tool_call>{"name": "g", "arguments": {}}</tool_call>'
    stream = ToolCallStream("hermes", accept=only_f)
    updates = [stream.feed(text[:end], end == len(text)) for end in range(1, len(text) + 1)]
    assert "".join(u.content for u in updates) == parsed.content
    assert [d.name for u in updates for d in u.calls] == ["f"]
    llama = parse_tool_calls('{"name": "g", "parameters": {}}', "llama3_json", only_f)
    assert llama.calls == [] and llama.content == '{"name": "g", "parameters": {}}'


def test_parallel_calls_off_returns_the_first_call_only() -> None:
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    one = CallReading("hermes", 1, False, lambda call: True)
    assert [c.name for c in one.parse(text).calls] == ["f"]
    assert one.keeps(0) and not one.keeps(1)
    both = CallReading("hermes", None, False, lambda call: True)
    assert [c.name for c in both.parse(text).calls] == ["f", "g"] and both.keeps(5)
