"""Reasoning split from answers (server/reasoning.py): whole replies, streams cut at every
point (tags split across deltas), token counts, the per-family choice, the chat-template
arguments that switch thinking, and the Anthropic stream's blocks around a thinking block."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from radixserve.model.families import family_named
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import CompletionOutput
from radixserve.server.anthropic.messages import MessagesExchange
from radixserve.server.errors import APIError
from radixserve.server.exchange import StreamCursor
from radixserve.server.prompts import template_arguments
from radixserve.server.reasoning import (
    NoReasoning,
    ReasoningStream,
    ThinkTags,
    format_for,
    reasoning_format,
    reasoning_tokens,
)
from radixserve.server.tool_calls.tools import CallReading
from tests.support.chat_templates import THINK_TEMPLATE

REPLIES = [
    ("<think>\nadd two and two\n</think>\n\nFour.", False, "add two and two", "Four."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Four, no reasoning.", False, "", "Four, no reasoning."),
    ("<thin", False, "", "<thin"),  # never became a tag: all answer
    ("<think>\ncut off by max_tokens", False, "cut off by max_tokens", ""),
    ("opened by the prompt\n</think>\n\nFour.", True, "opened by the prompt", "Four."),
    ("still inside when cut", True, "still inside when cut", ""),
    ("<think>x</think><tool_call>{\"name\": \"f\"}</tool_call>", False, "x",
     "<tool_call>{\"name\": \"f\"}</tool_call>"),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), REPLIES)
def test_a_finished_reply_splits_into_reasoning_and_answer(
        text: str, inside: bool, reasoning: str, content: str) -> None:
    split = ThinkTags(inside).split(text, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), REPLIES)
def test_a_stream_cut_anywhere_adds_up_to_the_split(
        text: str, inside: bool, reasoning: str, content: str) -> None:
    """Fed one character at a time, then in two pieces cut at every point: the reasoning
    deltas concatenate to the reasoning, the answer so far only grows, and no part of a tag
    is ever sent."""
    cuts = [list(range(1, len(text) + 1))] + [[k, len(text)] for k in range(1, len(text))]
    for ends in cuts:
        stream = ReasoningStream(ThinkTags(inside))
        sent, answer = "", ""
        for end in ends:
            update = stream.feed(text[:end], final=end == len(text))
            sent += update.reasoning
            assert update.content_so_far.startswith(answer)
            answer = update.content_so_far
            assert "<think" not in sent and "</" not in sent.replace("</tool", "")
            if update.reasoning_done is False:
                assert answer == ""
        assert (sent, answer) == (reasoning, content)


def test_a_reply_without_reasoning_is_all_answer_once_it_cannot_open_a_tag() -> None:
    stream = ReasoningStream(ThinkTags())
    assert stream.feed("<th", final=False).content_so_far == ""  # may still open
    update = stream.feed("<tho", final=False)
    assert update.content_so_far == "<tho" and update.reasoning_done


def test_reasoning_tokens_count_the_tokens_up_to_the_closing_tag() -> None:
    pieces = ["<think>", "\nmull", " it", "</", "think>", "\n\n", "Four", "."]
    ids = list(range(len(pieces)))

    def decode(prefix: list[int]) -> str:
        return "".join(pieces[i] for i in prefix)

    text = decode(ids)
    assert reasoning_tokens(ids, ThinkTags().split(text, final=True), decode) == 5
    assert reasoning_tokens(ids, ThinkTags().split("Four.", final=True), decode) == 0
    cut = ids[:3]  # cut off inside the reasoning: every token was reasoning
    assert reasoning_tokens(cut, ThinkTags().split(decode(cut), final=True), decode) == 3


def test_the_prompt_tail_tells_whether_the_reply_starts_inside_reasoning() -> None:
    assert reasoning_format("think", "<|im_start|>assistant\n<think>\n").inside
    assert not reasoning_format("think", "assistant\n<think>\n\n</think>\n\n").inside
    assert not reasoning_format("think", "<|im_start|>assistant\n").inside
    assert isinstance(reasoning_format("none", "<think>"), NoReasoning)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format("harmony")


def test_reasoning_families_default_to_think_tags_and_qwen3_to_hermes_calls() -> None:
    for name in ("qwen3", "qwen3_moe", "smollm3"):
        assert family_named(name).reasoning_parser == "think"
    assert family_named("qwen3").tool_call_parser == "hermes"
    assert family_named("qwen3_moe").tool_call_parser == "hermes"
    assert family_named("llama").reasoning_parser == "none"
    # auto: the family's format, else think where the template writes think tags
    assert format_for("think", None) == "think"
    assert format_for("none", THINK_TEMPLATE) == "think"
    assert format_for("none", "{{ messages }}") == "none"


def test_template_arguments_must_be_read_by_the_template_and_not_the_servers() -> None:
    assert template_arguments(THINK_TEMPLATE, {"enable_thinking": False}) == {
        "enable_thinking": False}
    for bad in ({"reasoning_effort": "high"}, {"add_generation_prompt": False}):
        with pytest.raises(APIError) as caught:
            template_arguments(THINK_TEMPLATE, bad)
        assert caught.value.status == 400


def _anthropic_events(text: str, cuts: list[int], calls: bool) -> list[dict[str, Any]]:
    """The content events a Messages stream sends for `text` generated in pieces ending at
    `cuts` (the engine's cumulative outputs, through the streaming loop's cursor)."""
    exchange = MessagesExchange(None, None, None, None, stream=True,  # type: ignore[arg-type]
                                prewarm=False, reasoning=ThinkTags(),
                                calls=CallReading("hermes", None, False, lambda call: True)
                                if calls else None)
    cursor = StreamCursor([])
    events = []
    for end in cuts:
        sample = CompletionOutput(0, text[:end], list(range(end)),
                                  "stop" if end == len(text) else None)
        event = exchange.delta_event(cursor.advance(0, sample))
        for chunk in (event or b"").split(b"\n\n"):
            if chunk:
                events.append(json.loads(chunk.split(b"data: ", 1)[1]))
    return events


@pytest.mark.parametrize("calls", [False, True])
def test_an_anthropic_stream_sends_a_thinking_block_then_the_answer(calls: bool) -> None:
    text = "<think>\nadd them\n</think>\n\nFour."
    for cuts in ([*range(1, len(text) + 1)], [9, 20, 27, len(text)]):
        events = _anthropic_events(text, cuts, calls)
        starts = [(e["index"], e["content_block"]["type"]) for e in events
                  if e["type"] == "content_block_start"]
        assert starts == [(0, "thinking"), (1, "text")]
        thinking = "".join(e["delta"]["thinking"] for e in events
                           if e["type"] == "content_block_delta" and e["index"] == 0)
        answer = "".join(e["delta"]["text"] for e in events
                         if e["type"] == "content_block_delta" and e["index"] == 1)
        assert (thinking, answer) == ("add them", "Four.")
        stop = events.index({"type": "content_block_stop", "index": 0})
        assert all(e.get("index") == 1 for e in events[stop + 1:])


def test_an_anthropic_stream_without_reasoning_is_one_text_block() -> None:
    events = _anthropic_events("Four.", [2, 5], calls=False)
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta",
                                           "content_block_delta"]
    assert events[0]["content_block"]["type"] == "text"


@pytest.mark.model
def test_the_template_switch_and_history_render_as_the_reasoning_split_expects(
        tokenizer: ChatTokenizer) -> None:
    chat = replace(tokenizer, chat_template=THINK_TEMPLATE)
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello"},
             {"role": "user", "content": "2+2?"}]

    def tail(**extra: Any) -> str:
        ids = chat.encode_chat(turns, **extra)
        return chat.decode(ids[-16:], skip_special_tokens=False)

    assert "hmm" not in chat.decode(chat.encode_chat(turns), skip_special_tokens=False)
    assert not reasoning_format("think", tail()).inside
    assert not reasoning_format("think", tail(enable_thinking=False)).inside
    assert tail(enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert reasoning_format("think", tail(enable_thinking=True)).inside
