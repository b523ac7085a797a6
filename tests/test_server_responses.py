"""The Responses API through the official openai SDK and the OpenAI Agents SDK against a real
server on the default model: create (text, instructions, parse into a Pydantic model), the
stream's events as the SDK parses them, forced and free function calls, a tool loop continued by
previous_response_id whose every turn hits the cache for the whole stored sequence, input_items,
delete, expiry, tenancy by API key, the refusals, and an agent run end to end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve.testing.server import ServerProcess, read_metrics
from tests.support.servers import openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-alice", "key-bob")
TTL_S = 600
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("responses")
    with running_server(tmp_path_factory, "--api-key", KEYS[0], "--api-key", KEYS[1],
                        "--responses-dir", str(store), "--responses-ttl", str(TTL_S),
                        "--enable-clock-control", "--max-model-len", "2048") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server, KEYS[0]) as c:
        yield c


@pytest.fixture(scope="module")
def other(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server, KEYS[1]) as c:
        yield c


def _greedy(**kwargs: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, "max_output_tokens": 48, **kwargs}


def test_text_with_instructions_is_chat_completions_greedy_output(client: openai.OpenAI) -> None:
    r = client.responses.create(**_greedy(input="Name a fruit.", instructions="Be brief.",
                                          include=["message.output_text.logprobs"],
                                          top_logprobs=2))
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=48,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a fruit."}])
    assert r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.output_text and r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text
    logprobs = r.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == r.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)
    count = client.responses.input_tokens.count(model=MODEL, input="Name a fruit.",
                                                instructions="Be brief.")
    assert count.input_tokens == r.usage.input_tokens


class Pet(BaseModel):
    name: str = Field(max_length=16)
    legs: int = Field(ge=0, le=8)


def test_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Describe a dog as JSON.", text_format=Pet,
                               temperature=0, max_output_tokens=100)
    assert isinstance(r.output_parsed, Pet)
    obj = client.responses.create(**_greedy(input="A cat as JSON.", max_output_tokens=60,
                                            text={"format": {"type": "json_object"}}))
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def _events(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    with client.responses.stream(**kwargs) as stream:
        return list(stream)


def test_stream_events_in_order_and_text_equal_to_non_streamed(client: openai.OpenAI) -> None:
    args = _greedy(input="Say hello to Ada.", max_output_tokens=24)
    whole = client.responses.create(**args)
    events = _events(client, **args)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{whole.status}"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    stored = events[-1].response
    # The stored response replays as the same stream.
    with httpx.stream("GET", f"{client.base_url}responses/{stored.id}", params={"stream": "true"},
                      headers={"authorization": f"Bearer {KEYS[0]}"}) as replay:
        lines = [json.loads(line[6:]) for line in replay.iter_lines() if line.startswith("data: ")]
    assert lines[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert [e["type"] for e in lines][:4] == kinds[:4]


def test_forced_and_free_function_calls(client: openai.OpenAI) -> None:
    forced = client.responses.create(**_greedy(input="What is the weather in Paris?",
                                               tools=[WEATHER], tool_choice="required",
                                               parallel_tool_calls=False, max_output_tokens=60))
    calls = [item for item in forced.output if item.type == "function_call"]
    assert forced.status == "completed" and len(calls) == 1 and len(forced.output) == 1
    assert calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    events = _events(client, **_greedy(input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       parallel_tool_calls=False, max_output_tokens=60))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds.count("response.function_call_arguments.delta") > 1
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    done = events[-1].response.output[0]
    assert done.type == "function_call" and json.loads(done.arguments) == json.loads(
        calls[0].arguments)
    # Free (auto): the small model answers in text here, and never with a malformed call.
    free = client.responses.create(**_greedy(input="Say hi.", tools=[WEATHER]))
    assert all(item.type == "message" for item in free.output) and free.output_text


READ = "prompt_cache_usage_tokens_total{api=openai,kind=read}"


def test_tool_loop_by_id_hits_the_whole_stored_sequence(client: openai.OpenAI,
                                                        server: ServerProcess) -> None:
    billed = read_metrics(server.base_url).get(READ, 0.0)
    cached = 0
    r = client.responses.create(**_greedy(
        input="Weather in Paris, Rome, Oslo, Lima, Kyiv and Bern?", tools=[WEATHER],
        instructions="You are a weather agent. Use the tools.", tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60))
    for turn in range(5):
        call = r.output[-1]
        assert call.type == "function_call", turn
        whole = r.usage.input_tokens + r.usage.output_tokens  # type: ignore[union-attr]
        r = client.responses.create(**_greedy(
            previous_response_id=r.id, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=60,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": f"{10 + turn}C and sunny"}]))
        usage = r.usage
        assert usage is not None and usage.input_tokens > whole
        # The stored prompt and output, all of it: the last sampled token and the forced
        # tokens after it (`"}}</tool_call>`) never went through the model while it answered,
        # and the finished turn computed them for its pin.
        assert usage.input_tokens_details.cached_tokens >= whole, turn
        cached += usage.input_tokens_details.cached_tokens
    items = client.responses.input_items.list(r.id, order="asc").data
    assert [item.type for item in items] == ["function_call_output"]
    assert items[0].output == "14C and sunny"  # type: ignore[union-attr]
    # The cost ledger billed these requests' reads (and the first turn's, if any).
    assert read_metrics(server.base_url)[READ] - billed >= cached


def test_delete_expiry_and_other_keys_are_404(client: openai.OpenAI, other: openai.OpenAI,
                                              server: ServerProcess) -> None:
    first = client.responses.create(**_greedy(input="Hi.", max_output_tokens=8))
    for attempt in (lambda: other.responses.retrieve(first.id),
                    lambda: other.responses.delete(first.id),
                    lambda: other.responses.create(**_greedy(input="Again.",
                                                             previous_response_id=first.id))):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client.responses.retrieve(first.id).id == first.id  # still there for its owner
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**_greedy(input="Again.", previous_response_id=first.id))
    kept = client.responses.create(**_greedy(input="Hello.", max_output_tokens=8))
    httpx.post(server.base_url + "/debug/clock/advance", json={"seconds": TTL_S + 1},
               headers={"authorization": f"Bearer {KEYS[0]}"}).raise_for_status()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unstored = client.responses.create(**_greedy(input="Hello.", max_output_tokens=4,
                                                 store=False))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
])
def test_unsupported_fields_are_400s_naming_them(client: openai.OpenAI, extra: dict[str, Any],
                                                 param: str) -> None:
    args = {"input": "Hi.", **extra}
    body = args.pop("extra_body", None)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, extra_body=body, **args)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_truncation_disabled_refuses_and_auto_drops_the_oldest(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": f"Note {i}: the shipment {i} left port {i}."}
             for i in range(12)]
    args = _greedy(input=items, max_output_tokens=1900)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**args)
    assert caught.value.code == "context_length_exceeded"
    raw = client.responses.with_raw_response.create(**args, truncation="auto")
    dropped = int(raw.headers["x-truncated-input-items"])
    assert 0 < dropped < len(items) and raw.parse().truncation == "auto"


def test_agents_sdk_runs_a_tool_and_continues_by_id(server: ServerProcess) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    async def run() -> tuple[Any, Any]:
        sdk = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEYS[0],
                                 max_retries=0, timeout=300)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=sdk)
        agent = agents.Agent(name="weather", instructions="Use the tools.", tools=[get_weather],
                             model=model, tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_tokens=60))
        first = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        chat = agent.clone(tools=[], model_settings=agents.ModelSettings(temperature=0,
                                                                         max_tokens=120))
        second = await agents.Runner.run(chat, "Thanks.", max_turns=1,
                                         previous_response_id=first.last_response_id)
        await sdk.close()
        return first, second

    first, second = asyncio.run(run())
    assert cities == ["Paris"] and first.final_output == "It is sunny in Paris."
    usage = second.raw_responses[-1].usage
    assert second.final_output and usage.input_tokens_details.cached_tokens > 100
