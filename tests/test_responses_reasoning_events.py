"""A Responses stream of a reply that reasons then answers, cut at every point: a reasoning item
(its reasoning_text deltas) then the answer's message item, adding up to the non-streamed
response's items; the answer's tool-call reader never sees the reasoning. No model: one
character per token, as the engine's cumulative outputs feed the streaming loop's cursor."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.exchange import StreamCursor
from radixserve.server.openai.responses_exchange import ResponsesExchange
from radixserve.server.openai.responses_protocol import ResponsesRequest
from radixserve.server.reasoning import ThinkTags
from radixserve.server.response_store import StoredResponse
from radixserve.server.serving import Job
from radixserve.server.tool_calls.tools import CallReading

TEXT = "plan the sum\n</think>\n\nFour."  # the prompt opened the think block


def _exchange(text: str, calls: bool) -> ResponsesExchange:
    ctx = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: text[:len(ids)]))
    record = StoredResponse(id="resp_test", tenant="", token_ids=[], prompt_len=3,
                            history_len=0, namespace=None)
    reading = CallReading("hermes", None, False, lambda call: True) if calls else None
    return ResponsesExchange(ctx, None, ResponsesRequest(stream=True), "m",  # type: ignore[arg-type]
                             Job([1, 2, 3], SamplingParams(max_tokens=64)), reading, record, 0,
                             ThinkTags(inside=True))


def _final(text: str) -> RequestOutput:
    return RequestOutput("resp_test", None, [1, 2, 3],
                         [CompletionOutput(0, text, list(range(len(text))), "stop")], True)


def _streamed(text: str, cuts: list[int], calls: bool) -> list[dict[str, Any]]:
    exchange, cursor, chunks = _exchange(text, calls), StreamCursor([]), []
    for end in cuts:
        sample = CompletionOutput(0, text[:end], list(range(end)),
                                  "stop" if end == len(text) else None)
        chunks.append(exchange.delta_event(cursor.advance(0, sample)) or b"")
    chunks.extend(exchange.closing_events([_final(text)]))
    return [json.loads(c.split(b"data: ", 1)[1]) for c in b"".join(chunks).split(b"\n\n") if c]


@pytest.mark.parametrize("calls", [False, True])
def test_a_reasoning_reply_streams_a_reasoning_item_then_the_answer(calls: bool) -> None:
    whole = _exchange(TEXT, calls).response_body([_final(TEXT)])
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan the sum"}]
    assert whole["output"][1]["content"][0]["text"] == "Four."
    # The reasoning's tokens run to the end of its closing tag.
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == TEXT.index("\n\n")
    for cuts in ([*range(1, len(TEXT) + 1)], [5, 14, 17, 24, len(TEXT)]):
        events = _streamed(TEXT, cuts, calls)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["reasoning", "message"]
        reasoning = "".join(e["delta"] for e in events
                            if e["type"] == "response.reasoning_text.delta")
        answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert (reasoning, answer) == ("plan the sum", "Four.")
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [{k: v for k, v in item.items() if k != "id"} for item in done] == \
            [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]


def test_a_reply_cut_off_while_reasoning_has_no_message() -> None:
    text = "still thinking about"
    whole = _exchange(text, False).response_body([_final(text)])
    assert [item["type"] for item in whole["output"]] == ["reasoning"]
    events = _streamed(text, [*range(1, len(text) + 1)], False)
    assert not [e for e in events if e["type"].startswith("response.output_text")]
