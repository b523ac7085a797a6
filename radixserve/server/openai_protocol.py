"""OpenAI request bodies as strict pydantic models (see `transport.StrictModel`), and builders
for the response bodies.

Fields documented by OpenAI that we accept but do not act on are listed in `IGNORED_FIELDS`;
every other field is either acted on or refused with a 400 naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from radixserve.outputs import CompletionOutput
from radixserve.server.errors import bad_request
from radixserve.server.transport import StrictModel

# Accepted without error, not acted on. prompt_cache_key only routes between OpenAI's
# machines (we are one); the penalties, logit_bias and response_format are not implemented.
IGNORED_FIELDS = (
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "tool_choice",
    "response_format", "frequency_penalty", "presence_penalty", "logit_bias", "modalities",
    "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options", "functions",
    "function_call",
)

# More stop strings make every streamed chunk's hold-back check slower.
MAX_STOP_SEQUENCES = 16
# JSON has no infinity; a -inf log-probability is sent as this, as vLLM does.
_MIN_LOGPROB = -9999.0
TokenText = Callable[[int], str]  # a token id's text


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


class GenerationRequest(StrictModel):
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
    # Typed so a wrong type is still a 400, though not acted on.
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # Extensions (vLLM's names): cache_salt is the tenant namespace of the prefix cache.
    cache_salt: str | None = Field(None, min_length=1)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def sampling_options(self) -> dict[str, Any]:
        """SamplingParams arguments for the fields set (`validation.SamplingFields`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise bad_request(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", "stop")
        options = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                   "seed": self.seed, "stop": stop, "stop_token_ids": self.stop_token_ids,
                   "n": self.n, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                   "logprobs": self.top_logprob_count()}
        return {name: value for name, value in options.items() if value is not None}

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

    def top_logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def field_name(self, option: str) -> str:
        return "top_logprobs" if option == "logprobs" else option


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    def top_logprob_count(self) -> int | None:
        return self.logprobs


# ----- response bodies -----


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Chat/completions `usage`; the details objects are always present, zeros included."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
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
    entries: list[tuple[float, dict[int, float]]], token_ids: list[int], token_text: TokenText,
    text_offset: int,
) -> dict[str, Any]:
    """`choices[i].logprobs` of legacy completions: parallel lists, offsets into the text."""
    tokens, offsets = [], []
    for tid in token_ids[: len(entries)]:
        offsets.append(text_offset)
        tokens.append(token_text(tid))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp) for lp, _ in entries],
        "top_logprobs": [{token_text(t): _logprob(v) for t, v in top.items()}
                         for _, top in entries],
        "text_offset": offsets,
    }
