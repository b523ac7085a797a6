"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.outputs import CompletionOutput
from radixserve.server.auth import cache_namespace
from radixserve.server.context import ServerContext
from radixserve.server.exchange import Delta, handle
from radixserve.server.openai_exchange import OpenAIExchange, stream_flags
from radixserve.server.openai_protocol import ChatCompletionRequest, chat_logprobs, finish_reason
from radixserve.server.prompts import render_chat
from radixserve.server.serving import Job
from radixserve.server.transport import parse_body
from radixserve.server.validation import checked_sampling_params


async def create_chat_completion(request: Request) -> Response:
    return await handle(request, prepare_chat)


async def prepare_chat(ctx: ServerContext, request: Request, raw: bytes) -> ChatExchange:
    body = parse_body(raw, ChatCompletionRequest)
    model = ctx.check_model(body.model)
    flags = stream_flags(body)
    prompt_ids = await asyncio.to_thread(render_chat, ctx.tokenizer, body.messages, body.tools)
    params = checked_sampling_params(ctx, body, prompt_ids,
                                     body.max_completion_tokens or body.max_tokens, "messages")
    namespace = cache_namespace(ctx.settings, request.state.api_key, body.cache_salt)
    return ChatExchange(ctx, model, flags, [Job(prompt_ids, params, namespace)])


class ChatExchange(OpenAIExchange):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, job: int, sample: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if self.wants_logprobs(job):
            logprobs = chat_logprobs(sample.logprobs or [], sample.token_ids, self.ctx.token_text)
        return {"index": sample.index,
                "message": {"role": "assistant", "content": sample.text, "refusal": None},
                "logprobs": logprobs, "finish_reason": finish_reason(sample)}

    def opening_events(self) -> list[bytes]:
        # The role first, one chunk per choice, before the engine has produced anything.
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                for i in range(self.jobs[0].params.n)]

    def choice_delta(self, delta: Delta, logprobs: bool) -> dict[str, Any]:
        sample, span = delta.sample, slice(delta.token_start, delta.token_end)
        return {"index": sample.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": chat_logprobs((sample.logprobs or [])[span], sample.token_ids[span],
                                          self.ctx.token_text) if logprobs else None,
                "finish_reason": finish_reason(sample) if delta.finishing else None}
