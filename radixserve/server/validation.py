"""The checks every generation request passes before admission, whatever its API: its sampling
parameters (`SamplingParams.validate` decides; its error is restated under the body's own name
for the field), its completion budget against the context window, and its prompt (the engine's
own `check_prompt`). Each failure is a 400, which each API renders in its own error shape.
"""

from __future__ import annotations

from typing import Any, Protocol

from radixserve.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, bad_request

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Sent when --max-tokens-policy clamp lowered a request's max_tokens: "REQUESTED->GRANTED".
MAX_TOKENS_HEADER = "x-radixserve-max-tokens-clamped"


class SamplingFields(Protocol):
    """A request body that sets sampling parameters: OpenAI's chat and completions bodies,
    Anthropic's Messages body."""

    def sampling_options(self) -> dict[str, Any]:
        """SamplingParams keyword arguments for the fields the body sets (max_tokens aside)."""
        ...

    def field_name(self, option: str) -> str:
        """The body's name for a SamplingParams field (Anthropic calls `stop` stop_sequences)."""
        ...


def build_sampling_params(body: SamplingFields, max_tokens: int, vocab_size: int,
                          structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The request's SamplingParams (with `structured`, its output constraint); 400 naming the
    body's field when one is out of range."""
    try:
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=structured,
                                **body.sampling_options())
        params.validate(vocab_size)
    except SamplingParamError as exc:
        name = body.field_name(exc.field)
        raise bad_request(f"{name} {exc.problem}", name) from None
    return params


def _context_error(prompt_len: int, requested: int | None, context: int, param: str) -> APIError:
    if requested is None:
        message = (f"The prompt is {prompt_len} tokens; this model's context is {context} tokens "
                   "(one more is needed for the completion). Shorten the prompt.")
    else:
        message = (f"The request needs {prompt_len + requested} tokens ({prompt_len} in the "
                   f"prompt, {requested} for the completion); this model's context is {context}."
                   " Shorten the prompt or lower max_tokens.")
    return bad_request(message, param, code=CONTEXT_LENGTH_EXCEEDED)


def completion_budget(ctx: ServerContext, requested: int | None, prompt_len: int, param: str) -> int:
    """max_tokens as asked, or all the room left in the context and the KV pool.

    Prompt and completion must fit in the context window: the APIs refuse (400) what the engine
    would accept and cut short at the context's end, unless the max_tokens policy is "clamp",
    which lowers max_tokens to the room the context leaves.
    """
    context = ctx.max_model_len
    if requested is not None and prompt_len + requested > context \
            and ctx.settings.max_tokens_policy == "clamp" and prompt_len < context:
        # The caller reports the clamp (MAX_TOKENS_HEADER).
        return max(1, min(context, ctx.kv_capacity) - prompt_len)
    if prompt_len + (requested or 1) > context:
        raise _context_error(prompt_len, requested, context, param)
    if requested is not None:
        return requested
    return max(1, min(context, ctx.kv_capacity) - prompt_len)


def clamp_headers(requested: int | None, granted: list[int]) -> dict[str, str]:
    """MAX_TOKENS_HEADER where the max_tokens policy lowered a request's max_tokens (a
    request of several prompts reports the least any of them was granted)."""
    least = min(granted, default=None)
    if requested is None or least is None or least >= requested:
        return {}
    return {MAX_TOKENS_HEADER: f"{requested}->{least}"}


def _sentence(exc: ValueError) -> str:
    text = str(exc)
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def check_prompt(ctx: ServerContext, prompt_ids: list[int], params: SamplingParams,
                 param: str) -> None:
    """The engine's `check_prompt` (empty, ids outside the vocabulary, longer than the context,
    more than the KV pool holds with its completion) as a 400 naming `param`; with code
    context_length_exceeded where the prompt alone passes, so the completion did not fit."""
    engine = ctx.engine
    try:
        engine.check_prompt(prompt_ids, params)
    except ValueError as exc:
        try:
            engine.check_prompt(prompt_ids, SamplingParams(max_tokens=0))
            code: str | None = CONTEXT_LENGTH_EXCEEDED
        except ValueError:
            code = None
        raise bad_request(_sentence(exc), param, code=code) from None


def checked_sampling_params(
    ctx: ServerContext, body: SamplingFields, prompt_ids: list[int], requested: int | None,
    param: str, structured: tuple[StructuredOutputsParams, str] | None = None,
) -> SamplingParams:
    """Validates a request with one prompt: its budget (`requested` max_tokens, or None for
    all the room left), its sampling parameters, its output constraint (`structured`: the
    constraint and the body's field that asked for it, named when it cannot be compiled) and
    its prompt. `param` names the prompt in errors."""
    max_tokens = completion_budget(ctx, requested, len(prompt_ids), param)
    spec, field = structured if structured else (None, "")
    params = build_sampling_params(body, max_tokens, ctx.vocab_size, spec)
    if spec is not None:
        try:
            ctx.engine.grammars.check(spec)
        except ValueError as exc:
            raise bad_request(f"{field}: {exc}", field) from None
    check_prompt(ctx, prompt_ids, params, param)
    return params
