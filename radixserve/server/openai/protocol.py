"""OpenAI request bodies as strict pydantic models (see `transport.StrictModel`), and builders
for the response bodies.

Fields documented by OpenAI that we accept but do not act on are listed in `IGNORED_FIELDS`;
every other documented field is either acted on or refused with a 400 naming it. The ignored
ones a request sets, and any field this server does not know (the SDKs pass new fields
through, so they are said rather than refused), are named in the response's
`x-radixserve-not-applied` header (`not_applied_headers`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import Field

from radixserve.outputs import CompletionOutput, TokenLogprob
from radixserve.server.errors import bad_request
from radixserve.server.tool_calls.constraints import ConstraintFields
from radixserve.server.transport import NOT_APPLIED_HEADER, StrictModel

# Accepted without error, not acted on. prompt_cache_key only routes between OpenAI's
# machines (we are one); the others describe the caller or OpenAI's storage and billing,
# and change nothing in the output.
IGNORED_FIELDS = (
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
    "user", "metadata", "store", "service_tier",
)
# Documented by OpenAI and refused with a 400 naming the field when set (to anything but
# the value that means "off"): this server cannot honour them.
REFUSED_FIELDS = ("modalities", "audio", "prediction", "reasoning_effort", "verbosity",
                  "web_search_options", "functions", "function_call")
_OFF_VALUES: dict[str, Any] = {"modalities": ["text"]}


def refuse_unsupported(body: StrictModel) -> None:
    """400 naming the first of REFUSED_FIELDS that `body` sets (null or its off value aside)."""
    extra = body.model_extra or {}
    for name in REFUSED_FIELDS:
        value = extra.get(name)
        if value is not None and value != _OFF_VALUES.get(name):
            raise bad_request(f"{name} is not supported by this server (a text model without "
                              "audio, predictions, reasoning modes or web search; use tools "
                              "instead of the legacy functions).", name)


def not_applied_headers(body: StrictModel) -> dict[str, str]:
    """The not-applied header for `body`: the IGNORED_FIELDS it sets, then the fields this
    server does not know, by name (none: no header)."""
    extra = body.model_extra or {}
    declared = type(body).model_fields

    def value(name: str) -> Any:
        return getattr(body, name) if name in declared else extra.get(name)

    items = [name for name in IGNORED_FIELDS if value(name) is not None]
    items += sorted(name for name, v in extra.items()
                    if v is not None and name not in IGNORED_FIELDS)
    return {NOT_APPLIED_HEADER: ", ".join(items)} if items else {}


# More stop strings make every streamed chunk's hold-back check slower.
MAX_STOP_SEQUENCES = 16
# JSON has no infinity; a -inf log-probability is sent as this, as vLLM does.
_MIN_LOGPROB = -9999.0
TokenText = Callable[[int], str]  # a token id's text
# A logit_bias key: int() alone would also take " 7", "1_000" and thousands of digits.
_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class ContentPart(StrictModel):
    """One part of a message's content; only text parts can be rendered for a text model."""

    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier assistant turn's reasoning, sent back; templates that read it render it.
    reasoning_content: str | None = None


class GenerationRequest(ConstraintFields):
    """Fields chat and completions share."""

    model: str | None = None  # None: the first served name
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Ranges are SamplingParams.validate's; logit_bias keys are token ids written as strings.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # Extensions (vLLM's names): cache_salt is the tenant namespace of the prefix cache.
    cache_salt: str | None = Field(None, min_length=1)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # This request's speculative decoding (SamplingParams checks the values).
    speculative: str | None = None
    num_speculative_tokens: int | None = None

    def sampling_options(self) -> dict[str, Any]:
        """SamplingParams arguments for the fields set (`validation.SamplingFields`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise bad_request(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", "stop")
        options = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                   "seed": self.seed, "stop": stop, "stop_token_ids": self.stop_token_ids,
                   "n": self.n, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                   "logprobs": self.top_logprob_count(), "logit_bias": self.token_bias(),
                   "frequency_penalty": self.frequency_penalty,
                   "presence_penalty": self.presence_penalty,
                   "repetition_penalty": self.repetition_penalty,
                   "speculative": self.speculative,
                   "num_speculative_tokens": self.num_speculative_tokens}
        return {name: value for name, value in options.items() if value is not None}

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias by token id (OpenAI's JSON has string keys); their range is checked later."""
        if self.logit_bias is None:
            return None
        bad = [key for key in self.logit_bias if not _TOKEN_ID.fullmatch(key)]
        if bad:
            raise bad_request(f"logit_bias keys must be token ids (integers written as strings),"
                              f" got {bad[0]!r}.", "logit_bias")
        return {int(key): value for key, value in self.logit_bias.items()}

    def top_logprob_count(self) -> int | None:
        """Top log-probabilities wanted per token; None: no logprobs at all."""
        return None

    def field_name(self, option: str) -> str:
        return option


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Extra arguments to the chat template (vLLM's field), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None

    def top_logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def field_name(self, option: str) -> str:
        return "top_logprobs" if option == "logprobs" else option


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 computes the prompt and generates nothing: with echo and logprobs it scores the prompt
    # (lm-evaluation-harness's loglikelihood); without them the completion is just empty, as
    # with vLLM.
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = None
    # With echo, the prompt's tokens get log-probabilities too (the first has none: null).
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    def sampling_options(self) -> dict[str, Any]:
        options = super().sampling_options()
        if self.echo and self.logprobs is not None:
            options["prompt_logprobs"] = self.logprobs
        return options

    def top_logprob_count(self) -> int | None:
        return self.logprobs

    def field_name(self, option: str) -> str:
        return "logprobs" if option == "prompt_logprobs" else super().field_name(option)


# ----- response bodies -----


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning_tokens: int = 0) -> dict[str, Any]:
    """Chat/completions `usage`; the details objects are always present, zeros included."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens, "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0},
    }


def finish_reason(output: CompletionOutput) -> str | None:
    # "abort" and "error" never reach a client as a finish reason: they become errors.
    return output.finish_reason if output.finish_reason in ("stop", "length") else None


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def chat_logprobs(
    entries: list[tuple[float, dict[int, float]]], token_ids: list[int], token_text: TokenText
) -> dict[str, Any]:
    """`choices[i].logprobs` of chat: one entry per token, with its top alternatives."""

    def item(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(tid)
        return {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode())}

    content = []
    for tid, (lp, top) in zip(token_ids, entries, strict=False):
        entry = item(tid, lp)
        entry["top_logprobs"] = [item(t, v) for t, v in sorted(top.items(), key=lambda p: -p[1])]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob | None], token_ids: list[int], token_text: TokenText,
    text_offset: int,
) -> dict[str, Any]:
    """`choices[i].logprobs` of legacy completions: parallel lists, offsets into the text. An
    entry of None (an echoed prompt's first token, which has no context) is null in both
    token_logprobs and top_logprobs, as OpenAI sends it."""
    tokens, offsets = [], []
    for tid in token_ids[: len(entries)]:
        offsets.append(text_offset)
        tokens.append(token_text(tid))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else _logprob(e[0]) for e in entries],
        "top_logprobs": [None if e is None else {token_text(t): _logprob(v)
                                                 for t, v in e[1].items()}
                         for e in entries],
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two `completion_logprobs` objects as one (an echoed prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in first}
