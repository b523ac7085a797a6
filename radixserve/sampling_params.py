"""How to sample one request's output: the knobs users know from vLLM and the OpenAI API."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range setting."""
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 0,
             f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}"),
            (isinstance(self.n, int) and 1 <= self.n <= 128, f"n must be in [1, 128], got {self.n!r}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop),  # type: ignore[union-attr]
             "stop must be non-empty strings"),
            (0 <= self.min_tokens <= max(self.max_tokens, 0),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
