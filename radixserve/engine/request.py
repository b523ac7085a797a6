"""One sequence being served: its tokens, the KV slots that hold them, and its progress.

Slot ownership: `slots[:cache_len]` belong to the prefix cache (held through the locked
`cache_handle`); `slots[cache_len:]` are private to this request, in whole pages.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from radixserve.outputs import RequestMetrics
from radixserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: Hashable = None
    prompt: str | None = None
    # The index of this sample among the n of one user request (n > 1 runs n Requests).
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    slots: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in `slots`
    cache_len: int = 0  # leading slots owned by the prefix cache
    cache_handle: object | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    # cache_control breakpoints still to pin: (prompt token offset, TTL in seconds). The prefix
    # up to each offset is pinned in the cache once published, until arrival + TTL.
    pins: list[tuple[int, float]] = field(default_factory=list)
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(init=False)
    # Text state, kept by the engine's output processing.
    output_text: str = ""

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed + self.sample_index)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_private_slots(self) -> int:
        return len(self.slots) - self.cache_len

    @property
    def is_prefilling(self) -> bool:
        """True until every token but the newest has its K/V computed."""
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
