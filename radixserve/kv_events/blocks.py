"""Block hashes of KV cache events: the keys a router uses to ask "which replica holds this
prefix?". The engine publishes them (recorder.py); a router computes the same keys from a
request's tokens and looks them up (index.py).

The recipe, for an outside consumer:

    A block is `block_size` consecutive tokens starting at a multiple of `block_size`, counted
    from the start of the sequence; only full blocks have a hash (a partial tail has none).

    namespace_bytes(ns) = b""                                       if ns is None (shared cache)
                        = json.dumps(ns, separators=(",", ":"))     if ns is a str (cache_salt)
                        = json.dumps(list(ns), separators=(",", ":"))  if ns is a tuple
                          (e.g. ["tenant","<hex>",null] for an isolated API key), UTF-8 encoded
                          (radixserve/sequences.py; the disk tier's keys start from it too)
    root(ns)  = int.from_bytes(BLAKE2b(b"radixserve-kv-events-v1" + namespace_bytes(ns),
                                       digest_size=8), "big")
    h_0       = int.from_bytes(BLAKE2b(u64_be(root(ns)) + tokens_0, digest_size=8), "big")
    h_i       = int.from_bytes(BLAKE2b(u64_be(h_{i-1}) + tokens_i, digest_size=8), "big")

where tokens_i is block i's token ids as little-endian uint32 and u64_be(x) is
`x.to_bytes(8, "big")`. Hashes are unsigned 64-bit ints, as vLLM's `ExternalBlockHash` ints
are, so they travel as msgpack uint64. Each hash stands for the whole prefix up to the block's
end in one namespace: tenants never share a hash, and nothing depends on PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Hashable, Sequence

from radixserve.sequences import namespace_bytes

HASH_DOMAIN = b"radixserve-kv-events-v1"

# array("I") is the C unsigned int: 4 bytes on every platform CPython supports; checked once.
if array("I").itemsize != 4:  # pragma: no cover - no such platform in practice
    raise ImportError("radixserve.kv_events needs a 4-byte C unsigned int")


def namespace_root(namespace: Hashable) -> int:
    """The parent of a namespace's first block: a per-namespace seed, so tenants never share
    a hash even for identical tokens."""
    digest = hashlib.blake2b(HASH_DOMAIN + namespace_bytes(namespace), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the bytes the hash reads."""
    packed = array("I", tokens)
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI
        packed.byteswap()
    return packed.tobytes()


def block_hashes(
    tokens: Sequence[int],
    namespace: Hashable,
    block_size: int,
    start_block: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Hashes of the full blocks `start_block`, `start_block + 1`, ... of `tokens` (the whole
    sequence from token 0). `parent` is the hash of block `start_block - 1`, needed when
    `start_block > 0`, so that a caller holding the first hashes only extends them."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if start_block > 0 and parent is None:
        raise ValueError("block_hashes from start_block > 0 needs the parent block's hash")
    end_block = len(tokens) // block_size
    if end_block <= start_block:
        return []
    previous = namespace_root(namespace) if start_block == 0 else parent
    assert previous is not None
    data = token_bytes(tokens[start_block * block_size : end_block * block_size])
    # Chained as 8-byte digests and turned into ints in one unpack at the end: the loop runs
    # once per block, per request in the router, so it keeps to one BLAKE2b call.
    chained, digests, step = previous.to_bytes(8, "big"), [], 4 * block_size
    blake2b = hashlib.blake2b
    for at in range(0, len(data), step):
        chained = blake2b(chained + data[at : at + step], digest_size=8).digest()
        digests.append(chained)
    return list(struct.unpack(f">{len(digests)}Q", b"".join(digests)))
