"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixserve.outputs import RequestOutput
from radixserve.server.auth import cache_namespace
from radixserve.server.context import ServerContext, context_of
from radixserve.server.errors import APIError, bad_request
from radixserve.server.openai_common import (
    StreamCursor,
    check_sample,
    collect,
    error_event,
    event_stream,
    resolve_max_tokens,
    sampling_params,
    stream_flags,
)
from radixserve.server.prompts import render_chat
from radixserve.server.protocol import (
    ChatCompletionRequest,
    chat_logprobs,
    finish_reason,
    usage_body,
)
from radixserve.server.serving import Job
from radixserve.server.transport import SSE_DONE, parse_body, read_body, sse, until_disconnected


async def create_chat_completion(request: Request) -> Response:
    received = time.monotonic()
    ctx = context_of(request)
    ctx.service.check_open()
    body = parse_body(await read_body(request, ctx.settings.max_request_bytes),
                      ChatCompletionRequest)
    model = ctx.check_model(body.model)
    stream, include_usage = stream_flags(body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
    prompt_ids = await asyncio.to_thread(render_chat, ctx.tokenizer, body.messages, body.tools)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = resolve_max_tokens(ctx, requested, len(prompt_ids), "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(ctx, body, max_tokens, logprobs)
    job = Job(prompt_ids, params, cache_namespace(ctx.settings, request.state.api_key,
                                                  body.cache_salt))
    ctx.service.admit(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if stream:
        return event_stream(_chat_events(ctx, request_id, created, model, job, received,
                                       include_usage))
    connected, finals = await until_disconnected(
        request, collect(ctx, [job], request_id, received))
    if not connected or finals is None:
        return Response(status_code=499)  # nobody is listening; the status is for the log
    return JSONResponse(_chat_body(ctx, request_id, created, model, job, finals[0]))


def _chat_body(
    ctx: ServerContext, request_id: str, created: int, model: str, job: Job, out: RequestOutput
) -> dict[str, Any]:
    choices = []
    for sample in out.outputs:
        check_sample(sample)
        logprobs = None
        if job.params.logprobs is not None:
            logprobs = chat_logprobs(sample.logprobs or [], sample.token_ids, ctx.token_text)
        choices.append({
            "index": sample.index,
            "message": {"role": "assistant", "content": sample.text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": finish_reason(sample),
        })
    completion_tokens = sum(len(s.token_ids) for s in out.outputs)
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "system_fingerprint": None,
        "usage": usage_body(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens),
    }


async def _chat_events(
    ctx: ServerContext, request_id: str, created: int, model: str, job: Job, received: float,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": None}
    if include_usage:
        head["usage"] = None  # on every chunk but the last, as OpenAI sends it

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse({**head, "choices": [choice]})

    n = job.params.n
    for i in range(n):
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None})
    cursors = [StreamCursor(list(job.params.stop or [])) for _ in range(n)]  # type: ignore[arg-type]
    final: RequestOutput | None = None
    try:
        async with aclosing(ctx.service.generate([job], request_id, received)) as outputs:
            async for _, out in outputs:
                final = out
                for sample in out.outputs:
                    check_sample(sample)
                    cursor = cursors[sample.index]
                    text, start, end = cursor.advance(sample)
                    finishing = sample.finish_reason is not None and not cursor.done
                    wants_logprobs = job.params.logprobs is not None and end > start
                    if not (text or finishing or wants_logprobs):
                        continue
                    cursor.done = cursor.done or finishing
                    logprobs = None
                    if wants_logprobs:
                        logprobs = chat_logprobs((sample.logprobs or [])[start:end],
                                                 sample.token_ids[start:end], ctx.token_text)
                    yield chunk({"index": sample.index,
                                 "delta": {"content": text} if text else {},
                                 "logprobs": logprobs,
                                 "finish_reason": finish_reason(sample) if finishing else None})
    except APIError as error:
        yield error_event(error)
        yield SSE_DONE
        return
    if include_usage and final is not None:
        completion_tokens = sum(len(s.token_ids) for s in final.outputs)
        usage = usage_body(len(final.prompt_token_ids), completion_tokens,
                           final.num_cached_tokens)
        yield sse({**head, "choices": [], "usage": usage})
    yield SSE_DONE
