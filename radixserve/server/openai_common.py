"""What the OpenAI chat and completions routes share: the completion budget, sampling
parameters, streaming flags, collecting outputs, and stream cursors that hold back text which
may turn out to be a stop string."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, bad_request
from radixserve.server.protocol import MAX_STOP_SEQUENCES, GenerationRequest
from radixserve.server.serving import Job
from radixserve.server.transport import SSE_HEADERS, sse


def _context_error(prompt_len: int, max_tokens: int | None, limit: int, param: str) -> APIError:
    if max_tokens is None:
        message = (f"The prompt is {prompt_len} tokens; this model's context is {limit} tokens "
                   "(one more is needed for the completion). Shorten the prompt.")
    else:
        message = (f"The request needs {prompt_len + max_tokens} tokens ({prompt_len} in the "
                   f"prompt, {max_tokens} for the completion); this model's context is {limit}."
                   " Shorten the prompt or lower max_tokens.")
    return bad_request(message, param, code="context_length_exceeded")


def resolve_max_tokens(ctx: ServerContext, requested: int | None, prompt_len: int, param: str) -> int:
    """The completion budget: as asked, or all the context left (400 if it does not fit)."""
    context, capacity = ctx.max_model_len, ctx.kv_capacity
    if prompt_len >= context or (requested is not None and prompt_len + requested > context):
        raise _context_error(prompt_len, requested, context, param)
    if prompt_len >= capacity or (requested is not None and prompt_len + requested > capacity):
        raise bad_request(
            f"The request needs {prompt_len + (requested or 1)} tokens of KV cache; this server's "
            f"pool holds {capacity}. Shorten the prompt or lower max_tokens.", param,
            code="context_length_exceeded")
    return requested if requested is not None else min(context, capacity) - prompt_len


def sampling_params(
    ctx: ServerContext, body: GenerationRequest, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES:
        raise bad_request(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", "stop")
    if any(not s for s in stop):
        raise bad_request("Stop sequences must be non-empty strings.", "stop")
    stop_token_ids = list(body.stop_token_ids or [])
    if any(not 0 <= t < ctx.vocab_size for t in stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {ctx.vocab_size}).", "stop_token_ids")
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens}).",
                          "min_tokens")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            n=body.n or 1,
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            min_tokens=min_tokens,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def stream_flags(body: GenerationRequest) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options without stream is a 400, as with OpenAI."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return bool(body.stream), include_usage


def check_sample(sample: CompletionOutput) -> None:
    if sample.finish_reason == "error":
        raise APIError(500, "The model failed while generating this response; it has been "
                            "logged. Retry the request.", type="server_error")


async def collect(
    ctx: ServerContext, jobs: list[Job], request_id: str, received: float
) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(jobs)
    async with aclosing(ctx.service.generate(jobs, request_id, received)) as outputs:
        async for index, output in outputs:
            finals[index] = output
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that a stop string starts with."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


@dataclass
class StreamCursor:
    """How much of one sample's text and tokens a stream has sent."""

    stops: list[str]
    chars: int = 0
    tokens: int = 0
    done: bool = False

    def advance(self, sample: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token, end of new tokens). Text that may be the start of a
        stop string is held back until it is known not to be one: a stop is cut from the
        output, and streamed text cannot be taken back."""
        end = len(sample.text)
        if sample.finish_reason is None and self.stops:
            end -= partial_stop_len(sample.text, self.stops)
        text = sample.text[self.chars:end] if end > self.chars else ""
        self.chars = max(self.chars, end)
        start, self.tokens = self.tokens, len(sample.token_ids)
        return text, start, self.tokens


def error_event(error: APIError) -> bytes:
    # The SDK raises APIError on a data line whose JSON has an "error" key.
    return sse(error.openai_body())


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
