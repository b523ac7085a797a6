"""What a request returns: vLLM-shaped result objects (a contract users and tests rely on)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "error": the forward pass failed for this request (its KV was not kept).
FinishReason = Literal["stop", "length", "abort", "error"]
# One token's log-probability and its top alternatives {token id: logprob}, as vLLM returns
# them (the top ones need not include the token itself).
TokenLogprob = tuple[float, dict[int, float]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None  # None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # Per output token: (chosen token's logprob, {token id: logprob} of the top ones).
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context), as vLLM returns them; None when not asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Extra fields the server's accounting needs (not part of vLLM's shape).
    extra: dict[str, object] = field(default_factory=dict)
