"""POST /v1/completions: a prompt as text, a list of texts, token ids or lists of them; one job
per prompt, with `n` choices each, numbered prompt by prompt.

`echo` with `logprobs` scores the prompt too: its tokens' logprobs come first in each choice's
legacy logprobs object (the first token's null), offsets counted from the start of the echoed
text; with `max_tokens: 0` nothing is generated (lm-evaluation-harness's loglikelihood). A
stream sends the echo and the prompt's logprobs with each choice's first chunk.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from radixserve.server.auth import CacheNamespace, cache_namespace
from radixserve.server.context import ServerContext
from radixserve.server.errors import bad_request
from radixserve.server.exchange import Delta, handle
from radixserve.server.openai.exchange import OpenAIExchange, stream_flags
from radixserve.server.openai.protocol import (
    CompletionRequest,
    completion_logprobs,
    finish_reason,
    join_logprobs,
    not_applied_headers,
    refuse_unsupported,
)
from radixserve.server.serving import Job
from radixserve.server.transport import parse_body
from radixserve.server.validation import checked_sampling_params, clamp_headers

MAX_CHOICES = 256  # prompts x n in one request

Prompt = str | list[int]


async def create_completion(request: Request) -> Response:
    return await handle(request, prepare_completion)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _jobs(ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
          namespace: CacheNamespace) -> list[Job]:
    """One validated job per prompt (tokenizing the texts: run off the event loop)."""
    jobs = []
    structured = body.extension_constraint()
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        jobs.append(Job(ids, checked_sampling_params(ctx, body, ids, body.max_tokens, param,
                                                     structured), namespace))
    return jobs


async def prepare_completion(ctx: ServerContext, request: Request, raw: bytes) -> CompletionExchange:
    body = parse_body(raw, CompletionRequest)
    model = ctx.check_model(body.model)
    refuse_unsupported(body)
    flags = stream_flags(body)
    if body.suffix:
        raise bad_request("suffix (insertion) is not supported by this server.", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of other than n is not supported by this server.", "best_of")
    prompts = _prompt_list(body.prompt)
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise bad_request(f"At most {MAX_CHOICES} choices (prompts x n) per request.", "prompt")
    namespace = cache_namespace(ctx.settings, request.state.api_key, body.cache_salt)
    jobs = await asyncio.to_thread(_jobs, ctx, body, prompts, namespace)
    echoes = None
    if body.echo:
        echoes = [p if isinstance(p, str) else ctx.tokenizer.decode(job.prompt_ids)
                  for p, job in zip(prompts, jobs, strict=True)]
    exchange = CompletionExchange(ctx, model, flags, jobs, echoes)
    exchange.headers.update(clamp_headers(body.max_tokens, [j.params.max_tokens for j in jobs]))
    exchange.headers.update(not_applied_headers(body))
    return exchange


class CompletionExchange(OpenAIExchange):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, ctx: ServerContext, model: str, flags: tuple[bool, bool],
                 jobs: list[Job], echoes: list[str] | None) -> None:
        super().__init__(ctx, model, flags, jobs)
        self.echoes = echoes  # each prompt's text, sent before its choices' text (echo)
        self.n = jobs[0].params.n
        # Each job's prompt logprobs (echo with logprobs), from its latest output.
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * len(jobs)
        self._echoed: set[tuple[int, int]] = set()  # streamed choices whose echo went out

    def _echo(self, job: int) -> str:
        return self.echoes[job] if self.echoes else ""

    def _scores_prompt(self, job: int) -> bool:
        return bool(self.echoes) and self.wants_logprobs(job)

    def _prompt_part(self, job: int) -> dict[str, Any]:
        """The echoed prompt's share of a legacy logprobs object."""
        return completion_logprobs(self.prompt_logprobs[job] or [], self.jobs[job].prompt_ids,
                                   self.ctx.token_text, 0)

    def observe_output(self, job: int, output: RequestOutput) -> None:
        self.prompt_logprobs[job] = output.prompt_logprobs

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        for job, final in enumerate(finals):
            self.observe_output(job, final)
        return super().response_body(finals)

    def choice(self, job: int, sample: CompletionOutput) -> dict[str, Any]:
        prefix = self._echo(job)
        logprobs = None
        if self.wants_logprobs(job):
            logprobs = completion_logprobs(sample.logprobs or [], sample.token_ids,
                                           self.ctx.token_text, len(prefix))
            if self._scores_prompt(job):
                logprobs = join_logprobs(self._prompt_part(job), logprobs)
        return {"index": job * self.n + sample.index, "text": prefix + sample.text,
                "logprobs": logprobs, "finish_reason": finish_reason(sample)}

    def opening_events(self) -> list[bytes]:
        # An echo with logprobs waits for the prompt's logprobs: see `choice_delta`.
        if not self.echoes:
            return []
        return [self.chunk([{"index": j * self.n + i, "text": echo, "logprobs": None,
                             "finish_reason": None}])
                for j, echo in enumerate(self.echoes) if not self._scores_prompt(j)
                for i in range(self.n)]

    def choice_delta(self, delta: Delta, logprobs: bool) -> dict[str, Any]:
        sample, span = delta.sample, slice(delta.token_start, delta.token_end)
        offset = len(self._echo(delta.job)) + delta.text_offset
        choice = {"index": delta.job * self.n + sample.index, "text": delta.text,
                  "logprobs": completion_logprobs((sample.logprobs or [])[span],
                                                  sample.token_ids[span], self.ctx.token_text,
                                                  offset) if logprobs else None,
                  "finish_reason": finish_reason(sample) if delta.finishing else None}
        key = (delta.job, sample.index)
        if self._scores_prompt(delta.job) and key not in self._echoed:
            # A choice's first chunk comes once its prompt is computed, logprobs and all.
            self._echoed.add(key)
            choice["text"] = self._echo(delta.job) + delta.text
            generated = choice["logprobs"] or completion_logprobs([], [], self.ctx.token_text, 0)
            choice["logprobs"] = join_logprobs(self._prompt_part(delta.job), generated)
        return choice
