"""How to sample one request's output: the knobs users know from vLLM and the OpenAI API.

`SamplingParams.validate` is the one range check of these knobs; the servers translate its
`SamplingParamError` into their APIs' own parameter names and error shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamError(ValueError):
    """A sampling setting out of range: `field` names it, `problem` says what is wrong
    ("must be >= 0, got -1"), so a server can restate it under its API's name for the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


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
        ]
        for name, ok, problem in checks:
            if not ok:
                raise SamplingParamError(name, problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
