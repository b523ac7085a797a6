"""One sequence being served: its tokens, the KV slots that hold them, and its progress.

Slot ownership: `slots[:cache_len]` belong to the prefix cache (held through the locked
`cache_handle`); `slots[cache_len:]` are private to this request, in whole pages.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.cache.base import CacheHandle
from radixserve.engine.speculative.ngram_index import NgramIndex
from radixserve.engine.structured_output import GrammarMatcher
from radixserve.outputs import FinishReason, RequestMetrics, TokenLogprob
from radixserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted; its KV is being loaded from the disk tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: Hashable = None
    prompt: str | None = None
    # The index of this sample among the n of one user request (n > 1 runs n Requests), and
    # that user request's id (the request's own id when n == 1).
    sample_index: int = 0
    group_id: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output tokens in one list, grown by `append_output` (read in every step).
    token_ids: list[int] = field(init=False)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # One entry per prompt token computed so far (None for the first, which has no context),
    # when params.prompt_logprobs asks for them, else None. Complete at len(prompt_token_ids)
    # entries; each of n samples computes its own, so each has them before its first token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    _slots: list[int] = field(default_factory=list, repr=False)
    # An int32 copy of the leading slots for the decode kernel, extended lazily: appending a
    # page is the common change (one slot per decode token at page size 1). Replacing the
    # table (the setter) or re-pointing a slot (repoint_slot) keeps it in step; nothing else
    # may change a slot in place.
    _slot_array: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    _slots_mirrored: int = field(default=0, repr=False)
    num_computed: int = 0  # leading tokens whose K/V are in `slots`
    cache_len: int = 0  # leading slots owned by the prefix cache
    cache_handle: CacheHandle | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    # cache_control breakpoints still to pin: (token offset, TTL in seconds). The prefix up to
    # each offset is pinned in the cache once published, until arrival + TTL; an offset past
    # the prompt reaches into the output, as far as the finished request has KV.
    pins: list[tuple[int, float]] = field(default_factory=list)
    # False for the server's own requests (health probes, warm-up): they run like any other
    # but stay out of the cache counters, which describe the clients' traffic.
    counted: bool = True
    generator: torch.Generator | None = None
    # The disk tier's keys of this request's full blocks so far, and how many leading blocks
    # were handed to the tier already (see radixserve/engine/kv_offload.py).
    tier_keys: list[bytes] = field(default_factory=list, repr=False)
    tier_blocks_done: int = 0
    # The structured output's grammar state, when the request has one.
    matcher: GrammarMatcher | None = None
    # Output tokens taken without a model step (a sampled token and the forced tokens the
    # grammar jumped forward to after it) whose K/V is still to compute: the step that
    # computes them is an extend chunk, not a prefill of the prompt.
    jump_pending: int = 0
    # Speculation: the n-gram index of its own tokens (built on its first draft), and its
    # draft tokens verified and accepted so far (auto's acceptance estimate).
    draft_index: NgramIndex | None = field(default=None, repr=False)
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_rejections: int = 0  # verified drafts that ended at a rejected token
    metrics: RequestMetrics = field(init=False)
    # Text state, kept by the engine's output processing.
    output_text: str = ""

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.token_ids = self.prompt_token_ids + self.output_token_ids
        self.group_id = self.group_id or self.request_id
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed + self.sample_index)

    @property
    def slots(self) -> list[int]:
        """The KV slot of each position, in order; append with `slots.extend`."""
        return self._slots

    @slots.setter
    def slots(self, slots: list[int]) -> None:
        self._slots = slots
        self._slots_mirrored = 0

    def repoint_slot(self, index: int, slot: int) -> None:
        """Points position `index` at another slot holding the same K/V (a cache dedup)."""
        self._slots[index] = slot
        if index < self._slots_mirrored:
            self._slot_array[index] = slot

    def slot_array(self, end: int, start: int = 0) -> np.ndarray:
        """slots[start:end] as int32, a view valid until the table next changes."""
        have = self._slots_mirrored
        if end > have:
            if end > len(self._slot_array):
                grown = np.empty(max(end, 2 * len(self._slot_array), 64), np.int32)
                grown[:have] = self._slot_array[:have]
                self._slot_array = grown
            self._slot_array[have:end] = self._slots[have:end]
            self._slots_mirrored = end
        return self._slot_array[start:end]

    def truncate_slots(self, keep: int) -> list[int]:
        """Drops the slot table past `keep` entries (KV of rejected draft tokens); returns the
        dropped slots, which the caller gives back."""
        dropped = self._slots[keep:]
        del self._slots[keep:]
        self._slots_mirrored = min(self._slots_mirrored, keep)
        return dropped

    def slot_mirror_ok(self) -> bool:
        """Whether the int32 mirror still equals the slot list (a debug check)."""
        have = self._slots_mirrored
        return have <= len(self._slots) and self._slot_array[:have].tolist() == self._slots[:have]

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt log-probabilities are still to compute: the request must then
        compute its whole prompt (a cached position has no logits), see the scheduler."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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
        return self.token_ids[position]
