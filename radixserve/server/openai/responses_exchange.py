"""One POST /v1/responses as it generates: its output items (a reasoning item where the reply
reasons, the answer's message, its function calls), streamed as events or returned whole, with
honest usage, and the response stored as its exact tokens once finished.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError
from radixserve.server.exchange import Delta, Exchange
from radixserve.server.openai.protocol import chat_logprobs
from radixserve.server.openai.responses_protocol import ResponsesRequest
from radixserve.server.openai.responses_stream import OutputEvents
from radixserve.server.reasoning import (
    NoReasoning,
    ReasoningFormat,
    ReasoningSplit,
    ReasoningStream,
    reasoning_tokens,
)
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.server.serving import Job
from radixserve.server.tool_calls.parsers import ToolCallStream
from radixserve.server.tool_calls.tools import CallReading


class ResponsesExchange(Exchange):
    """One POST /v1/responses: its job, its output items (streamed as events or returned
    whole), and its storing once finished. Where the reply opens with reasoning (the
    `--reasoning-parser` format), that is a `reasoning` item before the answer's items; the
    tool-call reader sees only the answer."""

    def __init__(self, ctx: ServerContext, store: ResponseStore | None, body: ResponsesRequest,
                 model: str, job: Job, reading: CallReading | None, record: StoredResponse,
                 dropped_items: int, reasoning: ReasoningFormat | None = None) -> None:
        super().__init__(record.id, bool(body.stream))
        self.ctx = ctx
        self.store = store
        self.body = body
        self.model = model
        self.job = job
        self.reading = reading
        self.record = record
        self.dropped_items = dropped_items
        self.created = int(time.time())
        self.events = OutputEvents()
        self._calls: ToolCallStream | None = None
        self.reasoning = reasoning or NoReasoning()
        self._thinking: ReasoningStream | None = None
        self._answer_token: int | None = None  # streamed: where the answer's tokens start
        self._answer_sent = 0  # streamed: characters of the answer sent, without tools

    def start(self) -> list[Job]:
        return [self.job]

    def _headers(self) -> dict[str, str]:
        # truncation "auto" says what it left out.
        return {"x-truncated-input-items": str(self.dropped_items)} if self.dropped_items else {}

    def response_headers(self) -> dict[str, str]:
        return self._headers()

    def stream_headers(self) -> dict[str, str]:
        return self._headers()

    def _logprobs(self, sample: Any, span: slice) -> list[dict[str, Any]] | None:
        if self.job.params.logprobs is None:
            return None
        return chat_logprobs((sample.logprobs or [])[span], sample.token_ids[span],
                             self.ctx.token_text)["content"]

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        body = self.body
        text_format = (body.text.format if body.text else None) or {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": self.store is not None,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs or 0, "truncation": body.truncation or "disabled",
            "usage": usage, "metadata": body.metadata or {}, "user": body.user,
        }

    def _reasoning_tokens(self, token_ids: list[int], split: ReasoningSplit) -> int:
        return reasoning_tokens(token_ids, split, self.ctx.tokenizer.decode)

    def _finish(self, final: RequestOutput) -> tuple[dict[str, Any], bytes]:
        """The finished response (stored, when `store`) and the events that close its stream."""
        sample = final.outputs[0]
        status = "incomplete" if sample.finish_reason == "length" else "completed"
        closing = self.events.finish(status)
        prompt, output = len(final.prompt_token_ids), len(sample.token_ids)
        thought = self._reasoning_tokens(sample.token_ids,
                                         self.reasoning.split(sample.text, final=True))
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": output, "output_tokens_details": {"reasoning_tokens": thought},
                 "total_tokens": prompt + output}
        body = self.response(status, self.events.output, usage)
        if self.store is not None:
            self.record = dataclasses.replace(
                self.record, body=body, token_ids=[*self.job.prompt_ids, *sample.token_ids],
                replica=final.extra.get("replica"))
            self.store.put(self.record)
        return body, closing

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        sample = finals[0].outputs[0]
        split = self.reasoning.split(sample.text, final=True)
        if split.reasoning:
            self.events.reasoning(split.reasoning)
        if split.reasoning_end == len(sample.text):
            return self._finish(finals[0])[0]  # cut off while reasoning: no answer
        everything = slice(self._reasoning_tokens(sample.token_ids, split), None)
        if self.reading is None:
            self.events.text(split.content, self._logprobs(sample, everything))
        else:
            parsed = self.reading.parse(split.content)
            if parsed.content or not parsed.calls:
                logprobs = None if parsed.calls else self._logprobs(sample, everything)
                self.events.text(parsed.content, logprobs)
            for i, call in enumerate(parsed.calls):
                self.events.call(i, call.name, call.arguments)
        return self._finish(finals[0])[0]

    def opening_events(self) -> list[bytes]:
        shell = self.response("in_progress", [], None)
        return [self.events.event("response.created", response=shell),
                self.events.event("response.in_progress", response=shell)]

    def delta_event(self, delta: Delta) -> bytes | None:
        sample = delta.sample
        if self.reading is None and isinstance(self.reasoning, NoReasoning):
            logprobs = self._logprobs(sample, slice(delta.token_start, delta.token_end))
            return self.events.text(delta.text, logprobs) if delta.text or logprobs else None
        final = sample.finish_reason is not None
        visible = sample.text if final else sample.text[: delta.text_offset + len(delta.text)]
        events, answer = self._reasoning_delta(delta, visible, final)
        if answer is None:
            return events or None
        if self.reading is None:
            text, self._answer_sent = answer[self._answer_sent:], len(answer)
            start = max(delta.token_start, self._answer_token or 0)
            logprobs = self._logprobs(sample, slice(start, delta.token_end))
            if text or logprobs:
                events += self.events.text(text, logprobs)
            return events or None
        if self._calls is None:
            self._calls = self.reading.stream()
        update = self._calls.feed(answer, final)
        events += self.events.text(update.content) if update.content else b""
        for call in update.calls:
            if self.reading.keeps(call.index):
                events += self.events.call(call.index, call.name, call.arguments)
        return events or None

    def _reasoning_delta(self, delta: Delta, visible: str, final: bool
                         ) -> tuple[bytes, str | None]:
        """The reasoning events of a streamed delta, and the answer so far (None while the
        reply is still reasoning, or was cut off in it)."""
        if isinstance(self.reasoning, NoReasoning):
            return b"", visible
        if self._thinking is None:
            self._thinking = ReasoningStream(self.reasoning)
        update = self._thinking.feed(visible, final)
        events = self.events.reasoning(update.reasoning) if update.reasoning else b""
        if not update.reasoning_done:
            return events, None
        split = self.reasoning.split(visible, final)
        if split.reasoning_end == len(visible) and final:
            return events, None
        if self._answer_token is None:
            self._answer_token = self._reasoning_tokens(
                delta.sample.token_ids[:delta.token_end], split)
        return events, update.content_so_far

    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        body, closing = self._finish(finals[0])
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [closing, self.events.event(kind, response=body)]

    def error_events(self, error: APIError) -> list[bytes]:
        failure = {"code": error.code or error.type, "message": error.message}
        return [self.events.event("response.failed",
                                  response=self.response("failed", self.events.output, None,
                                                         failure))]
