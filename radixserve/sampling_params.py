"""How to sample one request's output: the knobs users know from vLLM and the OpenAI API.

`SamplingParams.validate` is the one range check of these knobs; the servers translate its
`SamplingParamError` into their APIs' own parameter names and error shapes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

# Speculative decoding (radixserve/engine/speculative): off, drafts from the request's own
# tokens (ngram), also from its namespace's earlier requests (suffix), or suffix where the
# start-up cost model says a step gains from it (auto). The same values as config.py's.
SPECULATIVE_METHODS = ("off", "ngram", "suffix", "auto")
MAX_SPECULATIVE_TOKENS = 32


class SamplingParamError(ValueError):
    """A sampling setting out of range: `field` names it, `problem` says what is wrong
    ("must be >= 0, got -1"), so a server can restate it under its API's name for the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output's text, enforced token by token (vLLM's names): exactly one of
    a JSON schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular
    expression, one of a list of strings (`choice`), or a grammar (GBNF as llama.cpp writes it,
    or Lark)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(kinds) != 1:
            raise SamplingParamError(
                "structured_outputs", "must set exactly one of json, json_object, regex, choice "
                f"and grammar, got {sum(kinds)}")
        if self.choice is not None and not (self.choice and all(
                isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamError("structured_outputs", "choice must be non-empty strings")

    @functools.cached_property
    def key(self) -> tuple[str, str]:
        """(kind, source text): what a compiled grammar is cached by (a schema serialised
        once per request, not at each of its checks)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json,
                                                                           sort_keys=True)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar or ""


@dataclass
class SamplingParams:
    """Sampling settings for one request. `temperature=0` is greedy.

    `stop` strings end the output (they are cut from the text); `stop_token_ids` end it too, as
    does the model's end-of-turn token unless `ignore_eos`. `n` samples share the prompt's KV.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities to return per token
    min_tokens: int = 0
    # Log-probabilities of the prompt's tokens, with this many top alternatives each (vLLM's
    # name); None: none. A request that asks computes its whole prompt: it takes no prefix-cache
    # hit (a cached position has no logits; its cached tokens are 0) but still publishes its
    # KV for others (see the scheduler). With max_tokens 0 it only scores the prompt.
    prompt_logprobs: int | None = None
    # Added to a token's logit before sampling (OpenAI's logit_bias: token id -> [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # OpenAI's penalties on tokens already in the output, and vLLM's repetition_penalty on
    # tokens in the prompt or the output (1: off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    # This request's speculative decoding, overriding the engine's (None: the engine's).
    speculative: str | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises SamplingParamError naming the first out-of-range setting; with `vocab_size`,
        stop_token_ids must also be token ids of that vocabulary."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 0,
             f"must be an integer >= 0, got {self.max_tokens!r}"),
            ("temperature", self.temperature >= 0, f"must be >= 0, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0,
             f"must be an integer >= 0 (or -1 for off), got {self.top_k!r}"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= 128,
             f"must be in [1, 128], got {self.n!r}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             f"must be in [0, 20], got {self.logprobs}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),  # type: ignore[union-attr]
             "must be non-empty strings"),
            ("stop_token_ids", vocab_size is None
             or all(0 <= t < vocab_size for t in self.stop_token_ids),
             f"must be token ids in [0, {vocab_size})"),
            ("min_tokens", 0 <= self.min_tokens <= max(self.max_tokens, 0),
             f"must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"must be in [0, 20], got {self.prompt_logprobs}"),
            ("logit_bias", self.logit_bias is None or all(
                isinstance(t, int) and -100 <= b <= 100 and (vocab_size is None or 0 <= t < vocab_size)
                for t, b in self.logit_bias.items()),
             "must map token ids" + (f" in [0, {vocab_size})" if vocab_size else "")
             + " to values in [-100, 100]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2,
             f"must be in (0, 2], got {self.repetition_penalty}"),
            ("speculative", self.speculative is None or self.speculative in SPECULATIVE_METHODS,
             f"must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}"),
            ("num_speculative_tokens", self.num_speculative_tokens is None or (
                isinstance(self.num_speculative_tokens, int)
                and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS),
             f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
             f"got {self.num_speculative_tokens!r}"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise SamplingParamError(name, problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
