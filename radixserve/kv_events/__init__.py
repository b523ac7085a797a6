"""KV cache events: what each replica's prefix cache stores and evicts, published in vLLM's
schema over ZMQ so that a router (ours, llm-d, NVIDIA Dynamo) knows which prefixes each replica
really holds.

Engine side: the cache reports to a `KVEventRecorder`; the engine drains it once per step into
a `KVEventPublisher`. Router side: a `KVEventSubscriber` per replica feeds a `BlockIndex`, and
`block_hashes` turns a request's tokens into the keys to look up. `blocks.py` documents the
hash, `events.py` the wire schema, `publisher.py` the framing and replay.
"""

from radixserve.kv_events.blocks import block_hashes, namespace_root
from radixserve.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    decode_batch,
    encode_batch,
)
from radixserve.kv_events.index import BlockIndex
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.kv_events.recorder import KVEventRecorder
from radixserve.kv_events.subscriber import KVEventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventPublisher",
    "KVEventRecorder",
    "KVEventSubscriber",
    "block_hashes",
    "decode_batch",
    "encode_batch",
    "namespace_root",
]
