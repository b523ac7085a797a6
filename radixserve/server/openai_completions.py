"""POST /v1/completions: a prompt as text, a list of texts, token ids or lists of them."""

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
from radixserve.server.protocol import (
    CompletionRequest,
    completion_logprobs,
    finish_reason,
    usage_body,
)
from radixserve.server.serving import Job
from radixserve.server.transport import SSE_DONE, parse_body, read_body, sse, until_disconnected

MAX_CHOICES = 256  # prompts x n in one request


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _encode_prompts(ctx: ServerContext, prompts: list[str | list[int]]) -> list[list[int]]:
    encoded = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise bad_request("prompt must not be empty.", param)
        if any(not 0 <= t < ctx.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {ctx.vocab_size}).", param)
        encoded.append(ids)
    return encoded


async def create_completion(request: Request) -> Response:
    received = time.monotonic()
    ctx = context_of(request)
    ctx.service.check_open()
    body = parse_body(await read_body(request, ctx.settings.max_request_bytes), CompletionRequest)
    model = ctx.check_model(body.model)
    stream, include_usage = stream_flags(body)
    if body.suffix:
        raise bad_request("suffix (insertion) is not supported by this server.", "suffix")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of other than n is not supported by this server.", "best_of")
    prompts = _prompt_list(body.prompt)
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"At most {MAX_CHOICES} choices (prompts x n) per request.", "prompt")
    prompt_ids = await asyncio.to_thread(_encode_prompts, ctx, prompts)
    namespace = cache_namespace(ctx.settings, request.state.api_key, body.cache_salt)
    jobs = []
    for i, ids in enumerate(prompt_ids):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        max_tokens = resolve_max_tokens(ctx, body.max_tokens, len(ids), param)
        jobs.append(Job(ids, sampling_params(ctx, body, max_tokens, body.logprobs), namespace))
    echoes = None
    if body.echo:
        echoes = [p if isinstance(p, str) else ctx.tokenizer.decode(ids)
                  for p, ids in zip(prompts, prompt_ids, strict=True)]
    ctx.service.admit(len(jobs))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if stream:
        return event_stream(_completion_events(ctx, request_id, created, model, jobs, echoes,
                                             received, include_usage))
    connected, finals = await until_disconnected(
        request, collect(ctx, jobs, request_id, received))
    if not connected or finals is None:
        return Response(status_code=499)
    return JSONResponse(_completion_body(ctx, request_id, created, model, jobs, finals, echoes))


def _completion_usage(finals: list[RequestOutput]) -> dict[str, Any]:
    return usage_body(sum(len(f.prompt_token_ids) for f in finals),
                      sum(len(s.token_ids) for f in finals for s in f.outputs),
                      sum(f.num_cached_tokens for f in finals))


def _completion_body(
    ctx: ServerContext, request_id: str, created: int, model: str, jobs: list[Job],
    finals: list[RequestOutput], echoes: list[str] | None,
) -> dict[str, Any]:
    choices = []
    for j, (job, out) in enumerate(zip(jobs, finals, strict=True)):
        for sample in out.outputs:
            check_sample(sample)
            prefix = echoes[j] if echoes else ""
            logprobs = None
            if job.params.logprobs is not None:
                logprobs = completion_logprobs(sample.logprobs or [], sample.token_ids,
                                               ctx.token_text, len(prefix))
            choices.append({"index": j * job.params.n + sample.index, "text": prefix + sample.text,
                            "logprobs": logprobs, "finish_reason": finish_reason(sample)})
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "system_fingerprint": None, "usage": _completion_usage(finals)}


async def _completion_events(
    ctx: ServerContext, request_id: str, created: int, model: str, jobs: list[Job],
    echoes: list[str] | None, received: float, include_usage: bool,
) -> AsyncIterator[bytes]:
    head = {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None}
    if include_usage:
        head["usage"] = None

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse({**head, "choices": [choice]})

    n = jobs[0].params.n
    cursors = {(j, i): StreamCursor(list(job.params.stop or []))  # type: ignore[arg-type]
               for j, job in enumerate(jobs) for i in range(n)}
    offsets = dict.fromkeys(cursors, 0)
    if echoes:
        for (j, i) in cursors:
            offsets[(j, i)] = len(echoes[j])
            yield chunk({"index": j * n + i, "text": echoes[j], "logprobs": None,
                         "finish_reason": None})
    finals: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async with aclosing(ctx.service.generate(jobs, request_id, received)) as outputs:
            async for j, out in outputs:
                finals[j] = out
                for sample in out.outputs:
                    check_sample(sample)
                    key = (j, sample.index)
                    cursor = cursors[key]
                    text, start, end = cursor.advance(sample)
                    finishing = sample.finish_reason is not None and not cursor.done
                    wants_logprobs = jobs[j].params.logprobs is not None and end > start
                    if not (text or finishing or wants_logprobs):
                        continue
                    cursor.done = cursor.done or finishing
                    logprobs = None
                    if wants_logprobs:
                        logprobs = completion_logprobs((sample.logprobs or [])[start:end],
                                                       sample.token_ids[start:end],
                                                       ctx.token_text, offsets[key])
                    offsets[key] += len(text)
                    yield chunk({"index": j * n + sample.index, "text": text,
                                 "logprobs": logprobs,
                                 "finish_reason": finish_reason(sample) if finishing else None})
    except APIError as error:
        yield error_event(error)
        yield SSE_DONE
        return
    if include_usage and all(f is not None for f in finals):
        yield sse({**head, "choices": [], "usage": _completion_usage(finals)})  # type: ignore[arg-type]
    yield SSE_DONE
