"""Structured output and tool calls through the official SDKs against a real server on the
default model: `parse(response_format=Model)`, json_object, vLLM's guided fields, forced and
free tool calls (OpenAI tool_calls, streamed deltas, Anthropic tool_use blocks), refusals,
and an agent loop whose every turn hits the cache for its whole history.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve.server.anthropic.messages import THINKING_HEADER
from radixserve.testing.server import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


# ----- response_format -----


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=16)
    legs: int = Field(ge=0, le=8)


class Animal(BaseModel):
    """Pet as Anthropic's SDK can send it: the SDK moves numeric bounds and string lengths into
    the description, where no server enforces them, and keeps enums in the schema."""

    name: str
    legs: Literal[0, 2, 4, 6, 8]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favourite: Color
    height_m: float = Field(ge=0.5, le=2.5)
    pets: list[Pet] = Field(max_length=2)


class Verdict(BaseModel):
    answer: bool
    confidence: int = Field(ge=0, le=10)


@pytest.mark.parametrize("model, prompt", [
    (Person, "Describe a person with a pet as JSON."),
    (Verdict, "Is the sky blue? Answer as JSON."),
    (Pet, "Describe a dog as JSON."),
])
def test_parse_returns_an_object_of_the_model(client: openai.OpenAI, model: type[BaseModel],
                                              prompt: str) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=model,
            max_tokens=200, temperature=1.0, seed=seed)

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(ask, range(3)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop"
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, model)  # pydantic validated every bound and enum


def test_json_is_valid_for_twenty_seeds(client: openai.OpenAI) -> None:
    # json_object: any object, so a 135M model may wander inside a free string until
    # max_tokens; what it returns is then still the start of an object.
    def free(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, max_tokens=60, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": 'Reply with JSON: {"city": ..., "country": ...}'}],
            response_format={"type": "json_object"})

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(free, range(4)))
    for r in replies:
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
        else:  # cut by max_tokens: still a prefix of a JSON object
            assert (r.choices[0].message.content or "").startswith("{")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"type": "string", "maxLength": 12}},
              "required": ["city", "country"], "additionalProperties": False}

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, max_tokens=60, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Name a city and its country as JSON."}],
            extra_body={"guided_json": schema})

    # Twenty at once: each seed draws from its own generator, so batching changes nothing.
    with ThreadPoolExecutor(20) as pool:
        for r in pool.map(ask, range(20)):
            assert r.choices[0].finish_reason == "stop"
            value = json.loads(r.choices[0].message.content or "")
            assert set(value) == {"city", "country"} and all(len(v) <= 12
                                                             for v in value.values())


def test_guided_choice_regex_and_grammar(client: openai.OpenAI) -> None:
    def text(**extra: Any) -> str:
        r = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=12,
                                      temperature=1.0, seed=3, extra_body=extra)
        return r.choices[0].text

    assert text(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert text(structured_outputs={"choice": ["Yes!", "No."]}) in ("Yes!", "No.")
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(guided_regex=r"[0-9]{3}-[a-z]{2}"))
    assert text(guided_grammar='root ::= "A" ("B" | "C")') in ("AB", "AC")


def test_constraint_errors_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema"),
        ({"extra_body": {"guided_regex": "(a"}}, "guided_regex"),
        ({"extra_body": {"guided_json": {"type": "objectx"}}}, "guided_json"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
        ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0"),
        ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}]},
         "tools.0.function.strict"),
        ({"extra_body": {"audio": {"voice": "alloy"}}}, "audio"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4,
                                           **extra)  # type: ignore[call-overload]
        assert caught.value.param == param, (extra, caught.value.message)
    # "text" and the "off" values are no constraint at all.
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2,
                                       response_format={"type": "text"},
                                       extra_body={"modalities": ["text"]})
    assert r.choices[0].finish_reason == "length"


# ----- tool calls (OpenAI) -----


def _reassembled(stream: Any) -> tuple[list[tuple[str, str, str]], str | None, str, int]:
    """The calls (id, name, arguments) a client rebuilds from a chat stream, the finish
    reason, the content, and how many call deltas there were."""
    calls: dict[int, list[str]] = {}
    reason, content, deltas = None, "", 0
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                deltas += 1
                entry = calls.setdefault(d.index, ["", "", ""])
                entry[0] = d.id or entry[0]
                entry[1] += (d.function.name or "") if d.function else ""
                entry[2] += (d.function.arguments or "") if d.function else ""
    return [tuple(c) for _, c in sorted(calls.items())], reason, content, deltas  # type: ignore[misc]


@pytest.mark.parametrize("choice, name", [
    ("required", None),
    ({"type": "function", "function": {"name": "add"}}, "add"),
])
def test_forced_tool_calls_are_valid_and_stream_the_same(client: openai.OpenAI, choice: Any,
                                                         name: str | None) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for seed in range(2):
        args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, ADD], tool_choice=choice,
                    parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        r = client.chat.completions.create(**args)  # type: ignore[call-overload]
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0].function  # type: ignore[union-attr]
        assert call.name in schemas and name in (None, call.name)
        arguments = json.loads(call.arguments)
        schema = schemas[call.name]
        assert set(arguments) == set(schema["required"])  # no property beyond the declared
        for key, value in arguments.items():
            kind = schema["properties"][key]["type"]
            assert isinstance(value, str if kind == "string" else int)
            if kind == "integer":
                assert -1000 <= value <= 1000
        streamed, reason, content, deltas = _reassembled(
            client.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
        assert reason == "tool_calls" and content == ""
        # A forced call streams its arguments as they are generated, after a first delta with
        # the id and name.
        assert deltas > 1
        assert [(n, json.loads(a)) for _, n, a in streamed] == [(call.name, arguments)]
        assert streamed[0][0].startswith("call_")


def test_parallel_calls_and_the_sdk_stream_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                        tool_choice="required", max_tokens=60,
                                        temperature=0) as stream:
        for _ in stream:
            pass
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as cut:  # the helper refuses a reply cut short
            final = cut.completion  # (the small model may go on making calls up to the limit)
    calls = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason in ("tool_calls", "length")
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert len({c.id for c in calls}) == len(calls)


def test_tool_choice_none_and_auto(client: openai.OpenAI) -> None:
    # Auto: a plain answer here (the small model does not call), and never a malformed call.
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                       max_tokens=30, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # A model reply that is a call, fed back as an assistant turn, then asked with "none".
    history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       tool_choice="none", max_tokens=30, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop",
                                                                                       "length")


def test_agent_loop_hits_the_cache_for_its_whole_history(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent. Use the tools."},
        {"role": "user", "content": "Weather in Paris, Rome, Oslo, Lima and Kyiv?"}]
    previous_prompt = 0
    for turn in range(5):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=60, temperature=0)
        usage = r.usage
        assert usage is not None and r.choices[0].finish_reason == "tool_calls"
        if turn:
            # Everything the previous turn sent is cached (its prompt, less nothing).
            assert usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens >= previous_prompt - 1, turn
        previous_prompt = usage.prompt_tokens
        call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{10 + turn}C"})


# ----- Anthropic -----


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
                    "input_schema": WEATHER["function"]["parameters"]}]  # type: ignore[index]


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use(claude: anthropic.Anthropic, choice: dict[str, Any]) -> None:
    args = dict(model="claude-haiku-4-5", max_tokens=60, messages=ASK_WEATHER,
                tools=ANTHROPIC_TOOLS, tool_choice=choice)
    m = claude.messages.create(**args)  # type: ignore[arg-type]
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) >= 1
    assert uses[0].name == "get_weather" and set(uses[0].input) == {"city"}  # type: ignore[union-attr]
    assert uses[0].id.startswith("toolu_")  # type: ignore[union-attr]
    input_deltas: dict[int, int] = {}  # tool_use block -> its input_json_delta events
    with claude.messages.stream(**args) as stream:  # type: ignore[arg-type]
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                input_deltas[event.index] = input_deltas.get(event.index, 0) + 1
        final = stream.get_final_message()
    # The input streams as it is generated: more than one piece for a call.
    assert input_deltas and max(input_deltas.values()) >= 2
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"  # sampled (the vendor's API has no seed): same shape
    assert [(b.name, set(b.input)) for b in streamed] == [("get_weather", {"city"})] * len(streamed)  # type: ignore[union-attr,arg-type]


def test_anthropic_tool_choice_errors_and_thinking(claude: anthropic.Anthropic) -> None:
    for choice, tools in (({"type": "tool", "name": "nope"}, ANTHROPIC_TOOLS),
                          ({"type": "any"}, None), ({"type": "sometimes"}, ANTHROPIC_TOOLS)):
        with pytest.raises(anthropic.BadRequestError, match="tool"):
            claude.messages.create(model="claude-haiku-4-5", max_tokens=4,
                                   messages=ASK_WEATHER, tools=tools or [],  # type: ignore[arg-type]
                                   tool_choice=choice)  # type: ignore[arg-type]
    raw = claude.messages.with_raw_response.create(
        model="claude-haiku-4-5", max_tokens=3, messages=ASK_WEATHER,
        thinking={"type": "enabled", "budget_tokens": 1024})
    assert raw.headers.get(THINKING_HEADER, "").startswith("ignored")
    assert raw.parse().content[0].type == "text"
    plain = claude.messages.with_raw_response.create(model="claude-haiku-4-5", max_tokens=3,
                                                     messages=ASK_WEATHER)
    assert THINKING_HEADER not in plain.headers


def test_anthropic_output_format_parses(claude: anthropic.Anthropic) -> None:
    m = claude.messages.parse(model="claude-haiku-4-5", max_tokens=120, output_format=Animal,
                              messages=[{"role": "user", "content": "Describe a dog as JSON."}])
    assert m.stop_reason == "end_turn" and isinstance(m.parsed_output, Animal)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(model="claude-haiku-4-5", max_tokens=4, messages=ASK_WEATHER,
                               tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                               output_config={"format": {"type": "json_schema",
                                                         "schema": {"type": "object"}}})
