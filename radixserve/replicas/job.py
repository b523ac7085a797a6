"""What the ingress sends a replica for one prompt: rendered and tokenized once, at the ingress,
with the chained block hashes the prefix router scores replicas by."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReplicaJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: Hashable = None
    # Engine options (cache_control pins) as `LLMEngine.add_request` takes them.
    options: dict[str, Any] = field(default_factory=dict)
    # The prompt's full blocks of `block_size` tokens (`kv_events.blocks.block_hashes`).
    block_hashes: tuple[int, ...] = ()
    block_size: int = 0
    # The replica whose cache holds this prompt's prefix (a stored response's, continued by
    # `previous_response_id`): every router sends the job there while it lives.
    affinity: str | None = None


@dataclass(frozen=True)
class TextJob(ReplicaJob):
    """A job that also carries its prompt's text, for routers that match characters (Ray's
    PrefixCacheAffinityRouter reads a `prompt` attribute); compared against in the benchmark."""

    prompt: str = ""


@dataclass(frozen=True)
class ReplicaFacts:
    """What the ingress learns from a replica at start: fixed for the deployment."""

    model_path: str
    vocab_size: int
    max_model_len: int
    kv_capacity: int
    block_size: int  # tokens per KV-event block
    family: str = "llama"  # the model's family: the reply formats the ingress reads
    chat_template: str | None = None  # the engines' template (--chat-template included)
