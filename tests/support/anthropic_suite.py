"""The Anthropic SDK suite: what every deployment serving the Messages API must do (breakpoints
write then read, usage arithmetic streamed and not, TTL segments, count_tokens, pre-warming,
stop sequences, auth, errors, cost headers; the content blocks of a stream with tool calls), run
against a single server (test_anthropic_messages.py) and the replicas (test_replicas.py) through
the fixtures of the module that subclasses it."""

from __future__ import annotations

import json
import random
from typing import Any

import anthropic
import httpx
import pytest

from radixserve.bench.textgen import WordBank
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.provider_caching import chat_prompt, render_prompt, render_request
from radixserve.server.anthropic.messages import StreamBlocks
from radixserve.server.tool_calls.tools import CallReading
from radixserve.testing.server import ServerProcess, read_metrics

MODEL = "claude-sonnet-4-6"  # an alias of the served model (1,024-token profile)
KEY = "sk-ant-test-key"
USER = [{"role": "user", "content": "Summarise the text in one line."}]
EPHEMERAL = {"type": "ephemeral"}
# The SDK no longer has sampling arguments; the server still takes them from the body.
GREEDY = {"temperature": 0}


def prompt_total(usage: Any) -> int:
    """Anthropic has no total-input field: the three parts add up to the prompt."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def check_fields(usage: Any) -> None:
    """Every cache field present as an int, and the breakdown adds up to the writes."""
    for value in (usage.input_tokens, usage.cache_creation_input_tokens,
                  usage.cache_read_input_tokens, usage.cache_creation.ephemeral_5m_input_tokens,
                  usage.cache_creation.ephemeral_1h_input_tokens, usage.output_tokens):
        assert isinstance(value, int) and value >= 0, usage
    creation = usage.cache_creation
    assert usage.cache_creation_input_tokens == (creation.ephemeral_5m_input_tokens
                                                 + creation.ephemeral_1h_input_tokens)


def _block_events(text: str, incremental: bool) -> list[dict[str, Any]]:
    """The events of `text` streamed a character at a time through a message's blocks, with
    the closing content_block_stop."""
    blocks = StreamBlocks(CallReading("hermes", None, incremental, lambda call: True))
    frames = b"".join(b"".join(blocks.events(text[:end], end == len(text)))
                      for end in range(1, len(text) + 1))
    events = [json.loads(frame.split(b"data: ", 1)[1]) for frame in frames.split(b"\n\n")
              if frame]
    return [*events, {"type": "content_block_stop", "index": blocks.index}]


def _five_breakpoints() -> dict[str, Any]:
    return {"system": [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL}
                       for i in range(5)]}


class AnthropicSuite:
    """Subclassed as Test... by a module that provides `server` (a ServerProcess), `client` (an
    Anthropic client of it, with KEY) and `keyed_server` (a deployment that wants KEY)."""

    def test_system_prompt_breakpoint_writes_then_reads_streamed_and_not(
            self, client: anthropic.Anthropic, bank: WordBank) -> None:
        system = [{"type": "text", "text": bank.text(random.Random(1), 2000),
                   "cache_control": EPHEMERAL}]
        length = client.messages.count_tokens(model=MODEL, system=system, messages=USER).input_tokens
        raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=3, system=system,
                                                       messages=USER, extra_body=GREEDY)
        first = raw.parse()
        check_fields(first.usage)
        assert prompt_total(first.usage) == length
        assert first.usage.cache_read_input_tokens < 10  # at most the template's opening tokens
        written = first.usage.cache_creation_input_tokens
        assert written >= 2000 and first.usage.cache_creation.ephemeral_5m_input_tokens == written
        breakpoint_offset = first.usage.cache_read_input_tokens + written
        assert first.usage.input_tokens == length - breakpoint_offset
        assert raw.headers["request-id"].startswith("req_")
        assert float(raw.headers["x-radixserve-cost-usd"]) > 0

        with client.messages.stream(model=MODEL, max_tokens=3, system=system, messages=USER,
                                    extra_body=GREEDY) as stream:
            events = list(stream)
            second = stream.get_final_message()
        start = next(e for e in events if e.type == "message_start").message.usage
        check_fields(start)
        assert start.cache_read_input_tokens >= breakpoint_offset
        assert start.cache_creation_input_tokens == 0
        assert prompt_total(start) == length and prompt_total(second.usage) == length
        assert 1 <= second.usage.output_tokens <= 3

        other_user = [{"role": "user", "content": "Name one word from the text."}]
        third = client.messages.create(model=MODEL, max_tokens=2, system=system,
                                       messages=other_user)
        check_fields(third.usage)
        assert third.usage.cache_read_input_tokens >= breakpoint_offset  # the system stays cached
        assert third.usage.cache_creation_input_tokens == 0
        assert prompt_total(third.usage) == client.messages.count_tokens(
            model=MODEL, system=system, messages=other_user).input_tokens


    def test_sse_event_sequence(self, server: ServerProcess) -> None:
        body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": USER}
        with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=120,
                          headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
            assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
            frames = [block for block in r.read().decode().split("\n\n") if block]
        names, datas = [], []
        for frame in frames:
            event_line, data_line = frame.split("\n")
            names.append(event_line.removeprefix("event: "))
            datas.append(json.loads(data_line.removeprefix("data: ")))
        assert all(d["type"] == n for n, d in zip(names, datas, strict=True))
        deltas = names[3:-3]
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert deltas and set(deltas) == {"content_block_delta"}
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        usage = datas[0]["message"]["usage"]
        assert set(usage) >= {"input_tokens", "cache_creation_input_tokens",
                              "cache_read_input_tokens", "cache_creation", "output_tokens"}
        assert datas[0]["message"]["stop_reason"] is None
        final = datas[-2]
        assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
        assert final["usage"]["cache_read_input_tokens"] == usage["cache_read_input_tokens"]


    @pytest.mark.parametrize("incremental", [False, True])
    def test_stream_blocks_with_tool_calls(self, incremental: bool) -> None:
        text = ('Sure. <tool_call>{"name":"f","arguments":{"a":"}"}}</tool_call> Then '
                '<tool_call>{"name":"g","arguments":{}}</tool_call> Done.')
        events = _block_events(text, incremental)
        # Blocks open in order, each after the previous one stops; every block stops.
        opened = [e["index"] for e in events if e["type"] == "content_block_start"]
        stopped = [e["index"] for e in events if e["type"] == "content_block_stop"]
        assert opened == [1, 2, 3, 4] and stopped == [0, 1, 2, 3, 4]
        blocks: dict[int, list[Any]] = {0: [{"type": "text"}]}
        for e in events:
            if e["type"] == "content_block_start":
                blocks[e["index"]] = [e["content_block"]]
            elif e["type"] == "content_block_delta":
                blocks[e["index"]].append(e["delta"])
        text_of = {i: "".join(d.get("text", "") for d in b[1:]) for i, b in blocks.items()}
        assert [b[0]["type"] for b in blocks.values()] == ["text", "tool_use", "text", "tool_use",
                                                          "text"]
        # The content of the parse, "Sure.  Then  Done.", split where the calls were.
        assert (text_of[0], text_of[2], text_of[4]) == ("Sure.", "  Then", "  Done.")
        inputs = {i: [d["partial_json"] for d in b[1:]] for i, b in blocks.items()
                  if b[0]["type"] == "tool_use"}
        assert {i: "".join(parts) for i, parts in inputs.items()} == {1: '{"a":"}"}', 3: "{}"}
        assert len(inputs[1]) == (len('{"a":"}"}') if incremental else 1)


    def test_ttl_segments_split_the_writes(
            self, client: anthropic.Anthropic, bank: WordBank) -> None:
        rng = random.Random(2)
        tools = [{"name": "lookup", "description": bank.text(rng, 200),
                  "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
                  "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
        system = [{"type": "text", "text": bank.text(rng, 200), "cache_control": EPHEMERAL}]
        first = client.messages.create(model=MODEL, max_tokens=1, tools=tools, system=system,
                                       messages=USER, tool_choice={"type": "auto"})
        check_fields(first.usage)
        assert first.usage.cache_creation.ephemeral_1h_input_tokens >= 200
        assert first.usage.cache_creation.ephemeral_5m_input_tokens >= 200
        again = client.messages.create(model=MODEL, max_tokens=1, tools=tools, system=system,
                                       messages=USER, tool_choice={"type": "auto"})
        assert again.usage.cache_creation_input_tokens == 0
        assert again.usage.cache_read_input_tokens >= (first.usage.cache_read_input_tokens
                                                       + first.usage.cache_creation_input_tokens)
        assert prompt_total(again.usage) == prompt_total(first.usage)


    def test_count_tokens_is_the_rendered_prompt_length(
            self, client: anthropic.Anthropic, tokenizer: ChatTokenizer) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "system": [{"type": "text", "text": "Be terse.", "cache_control": EPHEMERAL}],
            "tools": [{"name": "add", "description": "Adds.", "input_schema": {
                "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}}],
            "messages": [
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"b": 3, "a": 2}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]},
            ],
        }
        counted = client.messages.count_tokens(**body).input_tokens
        expected = render_prompt(tokenizer, chat_prompt(render_request(body, "anthropic")))
        assert counted == len(expected.token_ids)
        # Tool inputs serialise with sorted keys: another key order is the same prompt.
        reordered = json.loads(json.dumps(body))
        reordered["messages"][1]["content"][0]["input"] = {"a": 2, "b": 3}
        first = client.messages.create(max_tokens=1, **body)
        second = client.messages.create(max_tokens=1, **reordered)
        assert prompt_total(first.usage) == prompt_total(second.usage) == counted
        assert second.usage.cache_read_input_tokens == counted - 1  # all but the one recomputed


    def test_max_tokens_zero_prewarms_the_cache(
            self, client: anthropic.Anthropic, bank: WordBank) -> None:
        system = [{"type": "text", "text": bank.text(random.Random(3), 500),
                   "cache_control": EPHEMERAL}]
        warm = client.messages.create(model=MODEL, max_tokens=0, system=system, messages=USER)
        assert warm.content == [] and warm.stop_reason == "max_tokens"
        assert warm.usage.output_tokens == 0 and warm.usage.cache_creation_input_tokens >= 500
        offset = warm.usage.cache_read_input_tokens + warm.usage.cache_creation_input_tokens
        later = client.messages.create(model=MODEL, max_tokens=2, system=system,
                                       messages=[{"role": "user", "content": "Go on."}])
        assert later.usage.cache_read_input_tokens >= offset
        assert later.usage.cache_creation_input_tokens == 0
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=0, system=system, messages=USER,
                                   stream=True)


    def test_stop_sequence(self, client: anthropic.Anthropic) -> None:
        messages = [{"role": "user", "content": "Count from one to ten in words."}]
        free = client.messages.create(model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY)
        text = free.content[0].text
        assert len(text) >= 4, text
        stop = text[2:4]
        cut = client.messages.create(model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY,
                                     stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert stop not in (cut.content[0].text if cut.content else "")


    @pytest.mark.parametrize(("extra", "message"), [
        (_five_breakpoints(),
         "A maximum of 4 blocks with cache_control may be provided. Found 5."),
        ({"system": [{"type": "text", "text": "a", "cache_control": EPHEMERAL}],
          "messages": [{"role": "user", "content": [
              {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
         "messages.0.content.0.cache_control.ttl: a ttl='1h' cache_control block must not come "
         "after a ttl='5m' cache_control block."),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "", "cache_control": EPHEMERAL},
            {"type": "text", "text": "hi"}]}]},
         "messages.0.content.0.text: cache_control cannot be set for empty text blocks"),
    ])
    def test_cache_control_errors_in_the_vendors_words(
            self, client: anthropic.Anthropic, extra: dict[str, Any], message: str) -> None:
        body = {"model": MODEL, "max_tokens": 1, "messages": USER, **extra}
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**body)
        error = info.value
        assert error.status_code == 400 and error.body["error"]["type"] == "invalid_request_error"
        assert error.body["type"] == "error" and error.body["error"]["message"].startswith(message)
        assert error.request_id and error.request_id.startswith("req_")


    def test_unknown_model_and_malformed_bodies(self, client: anthropic.Anthropic,
                                                server: ServerProcess) -> None:
        with pytest.raises(anthropic.NotFoundError) as info:
            client.messages.create(model="claude-nonexistent-9", max_tokens=1, messages=USER)
        assert info.value.body["error"] == {"type": "not_found_error",
                                            "message": "model: claude-nonexistent-9"}
        headers = {"x-api-key": KEY, "content-type": "application/json"}
        for content in (b"{not json", b'{"model": "%s", "messages": []}' % MODEL.encode(),
                        json.dumps({"model": MODEL, "max_tokens": "3", "messages": USER}).encode()):
            r = httpx.post(server.base_url + "/v1/messages", content=content, headers=headers,
                           timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.headers["request-id"] == r.json()["request_id"]


    def test_auth_by_x_api_key_or_bearer(self, keyed_server: ServerProcess) -> None:
        body = {"model": MODEL, "messages": USER}
        missing = httpx.post(keyed_server.base_url + "/v1/messages/count_tokens", json=body,
                             timeout=60)
        assert missing.status_code == 401
        assert missing.json()["error"] == {"type": "authentication_error",
                                           "message": "x-api-key header is required"}
        with anthropic.Anthropic(base_url=keyed_server.base_url, api_key="wrong",
                                 max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError):
                bad.messages.count_tokens(**body)
        with anthropic.Anthropic(base_url=keyed_server.base_url, auth_token=KEY, api_key=None,
                                 max_retries=0) as bearer:
            assert bearer.messages.count_tokens(**body).input_tokens > 0


    def test_metrics_count_dollars_spent_and_saved(self, server: ServerProcess,
                                                   client: anthropic.Anthropic) -> None:
        client.messages.create(model=MODEL, max_tokens=1, messages=USER)
        metrics = read_metrics(server.base_url)
        spent = metrics["request_cost_usd_total{api=anthropic}"]
        uncached = metrics["request_uncached_cost_usd_total{api=anthropic}"]
        assert 0 < spent < uncached  # the cached system prompts above paid off
        assert metrics["prompt_cache_saved_usd{api=anthropic}"] == pytest.approx(uncached - spent)
        assert metrics["prompt_cache_usage_tokens_total{api=anthropic,kind=read}"] > 2000
