"""What OpenAI's chat and completions routes share: the streaming flags, the response and chunk
envelopes, usage, and errors inside a stream (a data line whose JSON has an "error" key, which
the SDK raises as APIError). Each route's own part is its choices.
"""

from __future__ import annotations

import time
import uuid
from abc import abstractmethod
from typing import Any

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, bad_request
from radixserve.server.exchange import Delta, Exchange
from radixserve.server.openai.protocol import GenerationRequest, usage_body
from radixserve.server.serving import Job
from radixserve.server.transport import SSE_DONE, sse


def stream_flags(body: GenerationRequest) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options without stream is a 400, as with OpenAI."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return bool(body.stream), include_usage


def usage_of(finals: list[RequestOutput], reasoning_tokens: int = 0) -> dict[str, Any]:
    return usage_body(sum(len(f.prompt_token_ids) for f in finals),
                      sum(len(s.token_ids) for f in finals for s in f.outputs),
                      sum(f.num_cached_tokens for f in finals), reasoning_tokens)


class OpenAIExchange(Exchange):
    """A chat or completions request; subclasses say what a choice looks like."""

    id_prefix: str  # "chatcmpl", "cmpl"
    object_name: str  # the response's `object`
    chunk_object_name: str  # a stream chunk's `object`

    def __init__(self, ctx: ServerContext, model: str, flags: tuple[bool, bool],
                 jobs: list[Job]) -> None:
        stream, self.include_usage = flags  # from `stream_flags`
        super().__init__(f"{self.id_prefix}-{uuid.uuid4().hex}", stream, len(jobs))
        self.ctx = ctx
        self.model = model
        self.jobs = jobs
        self.created = int(time.time())
        # What the server did to the request, said in the response's headers (a clamped
        # max_tokens: validation.clamp_headers).
        self.headers: dict[str, str] = {}

    def response_headers(self) -> dict[str, str]:
        return self.headers

    def stream_headers(self) -> dict[str, str]:
        return self.headers

    def start(self) -> list[Job]:
        return self.jobs

    @abstractmethod
    def choice(self, job: int, sample: CompletionOutput) -> dict[str, Any]:
        """One choice of the non-streamed response."""

    @abstractmethod
    def choice_delta(self, delta: Delta, logprobs: bool) -> dict[str, Any]:
        """One choice of a stream chunk; `logprobs`: with those of the delta's tokens."""

    def reasoning_tokens(self, finals: list[RequestOutput]) -> int:
        """How many of the output tokens were reasoning (usage's reasoning_tokens)."""
        return 0

    def wants_logprobs(self, job: int) -> bool:
        return self.jobs[job].params.logprobs is not None

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [self.choice(j, sample) for j, final in enumerate(finals)
                   for sample in final.outputs]
        return {"id": self.response_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, "system_fingerprint": None,
                "usage": usage_of(finals, self.reasoning_tokens(finals))}

    def chunk(self, choices: list[dict[str, Any]], **usage: Any) -> bytes:
        head: dict[str, Any] = {"id": self.response_id, "object": self.chunk_object_name,
                                "created": self.created, "model": self.model,
                                "system_fingerprint": None}
        if self.include_usage:
            head["usage"] = None  # on every chunk but the last, as OpenAI sends it
        return sse({**head, "choices": choices, **usage})

    def delta_event(self, delta: Delta) -> bytes | None:
        logprobs = self.wants_logprobs(delta.job) and delta.token_end > delta.token_start
        if not (delta.text or delta.finishing or logprobs):
            return None
        return self.chunk([self.choice_delta(delta, logprobs)])

    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        usage = [self.chunk([], usage=usage_of(finals, self.reasoning_tokens(finals)))
                 ] if self.include_usage else []
        return [*usage, SSE_DONE]

    def error_events(self, error: APIError) -> list[bytes]:
        return [sse(error.openai_body()), SSE_DONE]
