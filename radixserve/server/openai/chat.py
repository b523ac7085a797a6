"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.server.auth import cache_namespace
from radixserve.server.context import ServerContext
from radixserve.server.exchange import Delta, handle
from radixserve.server.openai.exchange import OpenAIExchange, stream_flags
from radixserve.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    chat_logprobs,
    finish_reason,
    not_applied_headers,
    refuse_unsupported,
)
from radixserve.server.preamble_strip import strip_chat_preamble
from radixserve.server.prompts import message_dicts, render_chat, template_arguments
from radixserve.server.reasoning import (
    NoReasoning,
    ReasoningFormat,
    ReasoningStream,
    reasoning_tokens,
)
from radixserve.server.serving import Job
from radixserve.server.tool_calls.constraints import response_format_constraint
from radixserve.server.tool_calls.parsers import ToolCall, ToolCallStream
from radixserve.server.tool_calls.tools import (
    CallReading,
    call_reading,
    openai_tool_choice,
    openai_tools,
    turn_constraint,
)
from radixserve.server.transport import parse_body
from radixserve.server.validation import checked_sampling_params, clamp_headers


async def create_chat_completion(request: Request) -> Response:
    return await handle(request, prepare_chat)


async def prepare_chat(ctx: ServerContext, request: Request, raw: bytes) -> ChatExchange:
    body = parse_body(strip_chat_preamble(ctx, raw), ChatCompletionRequest)
    model = ctx.check_model(body.model)
    refuse_unsupported(body)
    flags = stream_flags(body)
    tools = openai_tools(body.tools)
    choice = openai_tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
    family = ctx.tool_call_parser
    formats = []
    if (response_format := response_format_constraint(body.response_format)) is not None:
        formats.append((response_format, "response_format"))
    if (extension := body.extension_constraint()) is not None:
        formats.append(extension)
    structured = turn_constraint(formats, tools, choice, family, '"none"')
    prompt_ids = await asyncio.to_thread(render_chat, ctx.tokenizer, body.messages, body.tools,
                                         body.chat_template_kwargs)
    requested = body.max_completion_tokens or body.max_tokens
    params = checked_sampling_params(ctx, body, prompt_ids, requested, "messages", structured)
    namespace = cache_namespace(ctx.settings, request.state.api_key, body.cache_salt)
    reading = call_reading(tools, choice, family, ctx.engine.grammars)
    job = Job(prompt_ids, params, namespace, notes=ctx.next_turn.note_for(prompt_ids, namespace))
    exchange = ChatExchange(ctx, model, flags, [job], reading,
                            ctx.reasoning_format(prompt_ids, structured is not None), body)
    exchange.headers.update(clamp_headers(requested, [params.max_tokens]))
    exchange.headers.update(not_applied_headers(body))
    return exchange


def _tool_call(call_id: str, call: ToolCall) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class _ChoiceStream:
    """One streamed choice's readers: its reasoning, then its answer's tool calls."""

    reasoning: ReasoningStream
    calls: ToolCallStream | None
    content_sent: int = 0  # of the answer, when there are no tools


logger = logging.getLogger(__name__)


class ChatExchange(OpenAIExchange):
    """The reasoning (`reasoning_content`, vLLM's and DeepSeek's field) is split from each
    choice first; the tool-call reader sees only the answer after it."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, ctx: ServerContext, model: str, flags: tuple[bool, bool],
                 jobs: list[Job], calls: CallReading | None = None,
                 reasoning: ReasoningFormat | None = None,
                 body: ChatCompletionRequest | None = None) -> None:
        super().__init__(ctx, model, flags, jobs)
        self.body = body  # the request, for its next turn's rendering (`next_turn`)
        self.calls = calls  # how tool calls are read; None: the text is all content
        self.reasoning = reasoning or NoReasoning()
        self._plain = calls is None and isinstance(self.reasoning, NoReasoning)
        self._streams: dict[int, _ChoiceStream] = {}  # per choice, unless plain
        self._call_ids: dict[tuple[int, int], str] = {}  # (choice, call) -> its id

    def _call_id(self, sample: int, call: int) -> str:
        return self._call_ids.setdefault((sample, call), f"call_{uuid.uuid4().hex[:24]}")

    def _finish_reason(self, sample: CompletionOutput, called: bool) -> str | None:
        reason = finish_reason(sample)
        return "tool_calls" if called and reason == "stop" else reason

    def choice(self, job: int, sample: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if self.wants_logprobs(job):
            logprobs = chat_logprobs(sample.logprobs or [], sample.token_ids, self.ctx.token_text)
        split = self.reasoning.split(sample.text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": split.content,
                                   "refusal": None}
        if not isinstance(self.reasoning, NoReasoning):
            message["reasoning_content"] = split.reasoning or None
        calls: list[ToolCall] = []
        if self.calls is not None:
            parsed = self.calls.parse(split.content)
            calls = parsed.calls
            if calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [_tool_call(self._call_id(sample.index, i), call)
                                         for i, call in enumerate(calls)]
        return {"index": sample.index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish_reason(sample, bool(calls))}

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        self._turn_ended(finals)
        return super().response_body(finals)

    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        self._turn_ended(finals)
        return super().closing_events(finals)

    def _turn_ended(self, finals: list[RequestOutput]) -> None:
        """One reply that ended its turn: the next turn's history, as the template will render
        it, goes to `next_turn` (off the event loop)."""
        if self.body is None or len(finals) != 1 or len(finals[0].outputs) != 1:
            return
        sample = finals[0].outputs[0]
        if sample.finish_reason != "stop":
            return  # cut off: the client cannot send this turn back as generated
        reply = {k: v for k, v in self.choice(0, sample)["message"].items()
                 if k in ("role", "content", "tool_calls")}
        replica = finals[0].extra.get("replica")  # behind --replicas: where the turn ran
        self.ctx.next_turn.spawn(self._analyse([*self.body.messages, ChatMessage(**reply)],
                                               [*finals[0].prompt_token_ids, *sample.token_ids],
                                               replica if isinstance(replica, str) else None))

    async def _analyse(self, messages: list[ChatMessage], generated: list[int],
                       replica: str | None) -> None:
        assert self.body is not None
        tokenizer = self.ctx.tokenizer
        template = tokenizer.chat_template or ""
        tools = self.body.tools if self.body.tools and "tools" in template else None
        try:
            dicts = message_dicts(messages, self.body.tools, template)
            extra = template_arguments(template, self.body.chat_template_kwargs)
            history, rewrite = await asyncio.to_thread(self.ctx.next_turn.analyse, tokenizer,
                                                       dicts, tools, extra, generated)
        except Exception:  # the reply renders oddly: the next request is served as ever
            logger.debug("next turn not rendered", exc_info=True)
            return
        if rewrite is not None:
            self.ctx.next_turn.record(history, rewrite, self.jobs[0].namespace, replica)
            self.ctx.metrics.template_rewrite(rewrite.tokens)

    def reasoning_tokens(self, finals: list[RequestOutput]) -> int:
        decode = self.ctx.tokenizer.decode
        return sum(reasoning_tokens(sample.token_ids,
                                    self.reasoning.split(sample.text, final=True), decode)
                   for final in finals for sample in final.outputs)

    def _split_delta(self, delta: Delta) -> tuple[dict[str, Any], bool]:
        """The delta of a streamed choice with reasoning or tools: reasoning, then the
        answer's content outside calls and its call deltas (the first of each with its id and
        name, later ones adding to its arguments), and whether the choice has called a
        tool."""
        sample = delta.sample
        stream = self._streams.get(sample.index)
        if stream is None:
            stream = self._streams[sample.index] = _ChoiceStream(
                ReasoningStream(self.reasoning),
                self.calls.stream() if self.calls is not None else None)
        final = sample.finish_reason is not None
        visible = sample.text if final else sample.text[: delta.text_offset + len(delta.text)]
        split = stream.reasoning.feed(visible, final)
        body: dict[str, Any] = {"reasoning_content": split.reasoning} if split.reasoning else {}
        if stream.calls is None or self.calls is None:
            content = split.content_so_far[stream.content_sent:]
            stream.content_sent = len(split.content_so_far)
            if content:
                body["content"] = content
            return body, False
        if not split.reasoning_done:
            return body, False
        update = stream.calls.feed(split.content_so_far, final)
        if update.content:
            body["content"] = update.content
        calls = [d for d in update.calls if self.calls.keeps(d.index)]
        if calls:
            body["tool_calls"] = [
                {"index": d.index, "id": self._call_id(sample.index, d.index), "type": "function",
                 "function": {"name": d.name, "arguments": d.arguments}}
                if d.name is not None else {"index": d.index, "function": {"arguments": d.arguments}}
                for d in calls]
        called = any(key[0] == sample.index for key in self._call_ids)
        return body, called

    def opening_events(self) -> list[bytes]:
        # The role first, one chunk per choice, before the engine has produced anything.
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                for i in range(self.jobs[0].params.n)]

    def delta_event(self, delta: Delta) -> bytes | None:
        if self._plain:
            return super().delta_event(delta)
        # Text held back as a possible call start, or a call's tokens before it closes: no
        # chunk until there is something to send.
        logprobs = self.wants_logprobs(delta.job) and delta.token_end > delta.token_start
        choice = self.choice_delta(delta, logprobs)
        if not (choice["delta"] or delta.finishing or logprobs):
            return None
        return self.chunk([choice])

    def choice_delta(self, delta: Delta, logprobs: bool) -> dict[str, Any]:
        sample, span = delta.sample, slice(delta.token_start, delta.token_end)
        body: dict[str, Any] = {"content": delta.text} if delta.text else {}
        called = False
        if not self._plain:
            body, called = self._split_delta(delta)
        return {"index": sample.index, "delta": body,
                "logprobs": chat_logprobs((sample.logprobs or [])[span], sample.token_ids[span],
                                          self.ctx.token_text) if logprobs else None,
                "finish_reason": self._finish_reason(sample, called) if delta.finishing else None}
