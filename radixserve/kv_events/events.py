"""KV cache events in vLLM's schema, and their msgpack wire form.

We match the form vLLM publishes since v0.26 (vllm-project/vllm#42892, which dropped
`array_like` from the event structs): the batch is a positional array
`[ts, [event, ...], data_parallel_rank]` (the rank left off when None, as msgspec's
`omit_defaults` trims a trailing default), and each event is a map tagged by its class name
under "type", with vLLM's field names:

    {"type": "BlockStored", "block_hashes": [u64, ...], "parent_block_hash": u64 | None,
     "token_ids": [int, ...], "block_size": int, "lora_id": None, "medium": "GPU" | "CPU",
     "lora_name": None, "extra_keys": [[ns_text] | None, ...]}      (extra_keys only when set)
    {"type": "BlockRemoved", "block_hashes": [u64, ...], "medium": "GPU" | "CPU"}
    {"type": "AllBlocksCleared"}

`extra_keys` keeps vLLM's meaning: one entry per block of `block_hashes`, holding the extra
inputs of that block's hash besides its tokens (vLLM: LoRA name, multimodal hashes,
cache_salt). Ours is the cache namespace: `[namespace_bytes(ns).decode()]` on every block of
a namespaced event (the compact JSON of blocks.py, so `'"my-salt"'` for cache_salt "my-salt"),
and no `extra_keys` at all for the shared namespace. vLLM stamps cache_salt on a request's
first block only, as its hash chain carries it on; we stamp every block so that an event that
starts mid-chain still names its tenant.

`decode_batch` also reads the older forms (a batch as a map, events as tagged arrays
`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]`) and ignores
fields it does not know, such as vLLM's `group_idx`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIA = ("GPU", "CPU")


@dataclass(frozen=True)
class BlockStored:
    """Full blocks newly cached, consecutive in one chain: block_hashes[0]'s parent is
    `parent_block_hash` (None for a sequence's first block), and token_ids holds
    len(block_hashes) x block_size tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "CPU"
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer cached."""

    block_hashes: list[int]
    medium: str | None = "CPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache holds nothing now."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one engine step, in order; `ts` is unix seconds."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    wire: list[Any] = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        wire.append(batch.data_parallel_rank)
    return msgpack.packb(wire)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in `payload`; ValueError when it is not a KV event batch."""
    try:
        wire = msgpack.unpackb(payload, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ValueError(f"not a msgpack KV event batch: {exc}") from exc
    if isinstance(wire, dict):
        ts, events, rank = wire.get("ts"), wire.get("events"), wire.get("data_parallel_rank")
    elif isinstance(wire, list) and len(wire) >= 2:
        ts, events, rank = wire[0], wire[1], (wire[2] if len(wire) > 2 else None)
    else:
        raise ValueError(f"not a KV event batch: {type(wire).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise ValueError("a KV event batch needs a number `ts` and a list `events`")
    return EventBatch(float(ts), [_event_from_wire(e) for e in events], rank)


def _event_to_wire(event: KVCacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        wire = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            # vLLM declares these three without defaults, so they are always on the wire.
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            wire["extra_keys"] = event.extra_keys
        return wire
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes,
                "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {event!r}")


# Field order of the legacy tagged arrays (vLLM before #42892), after the tag.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event_from_wire(wire: Any) -> KVCacheEvent:
    if isinstance(wire, list) and wire and wire[0] in _ARRAY_FIELDS:
        # Not strict: older producers send fewer fields, newer ones more than we know.
        fields = zip(_ARRAY_FIELDS[wire[0]], wire[1:], strict=False)
        wire = {"type": wire[0], **dict(fields)}
    if not isinstance(wire, dict):
        raise ValueError(f"not a KV cache event: {wire!r}")
    kind = wire.get("type")
    try:
        if kind == "BlockStored":
            extra = wire.get("extra_keys")
            return BlockStored(
                block_hashes=list(wire["block_hashes"]),
                parent_block_hash=wire["parent_block_hash"],
                token_ids=list(wire["token_ids"]),
                block_size=wire["block_size"],
                lora_id=wire.get("lora_id"),
                medium=wire.get("medium"),
                lora_name=wire.get("lora_name"),
                # msgpack has no tuples: vLLM's per-block tuples come back as lists.
                extra_keys=None if extra is None
                else [None if keys is None else tuple(keys) for keys in extra],
            )
        if kind == "BlockRemoved":
            return BlockRemoved(list(wire["block_hashes"]), wire.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except KeyError as exc:
        raise ValueError(f"{kind} event without {exc}") from exc
    raise ValueError(f"unknown KV cache event type {kind!r}")
