"""What names a block of KV in the tier: a model fingerprint, and a chained hash per block.

A block is `block_tokens` consecutive prompt tokens starting at a multiple of `block_tokens`.
Its key hashes its parent block's key, its tokens, the tenant namespace and the fingerprint, so
one key stands for the whole prefix up to the block's end, for one tenant, on one model as
computed here. The hash is BLAKE2b: stable across processes and machines (Python's `hash()` is
seeded per process, which gave LMCache's caches zero hits after every restart).

How an outside consumer computes the same keys (all integers little-endian):
    key(0 - 1) = fingerprint digest (16 bytes)
    key(i)     = BLAKE2b-128(key(i-1) || u32(len(ns)) || ns || u32 token ids of block i)
where `ns` is the namespace's canonical bytes, `namespace_bytes` in radixserve/sequences.py (the
KV events' spelling: b"" for the shared namespace, compact JSON otherwise).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Bump when the file format or the KV layout in it changes: older entries are then foreign.
KV_LAYOUT_VERSION = 3  # 3: keys hash the namespace's JSON bytes (2: its repr; XXH3-64
# checksums since 2, CRC-32 in 1)
KEY_BYTES = 16
_SAMPLES = 16  # pieces of a weights file read for its identity
_SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that decides the bits of the KV a prompt produces here.

    Two engines share tier entries only if every field is equal: the same weights (by content
    sample, not by path), computed in the same dtype, by the same projection and attention
    kernels, in the same layout.
    """

    weights: str  # content identity of the weights file(s): see weights_identity
    dtype: str
    quantization: str
    projections: str  # the linear method, with its kernel path (avx2, avx512, ...)
    attention: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    block_tokens: int
    layout_version: int = KV_LAYOUT_VERSION
    software: str = ""  # radixserve and torch versions
    # The rotary tables keys were turned by (model.rope.rotary_identity): LongRoPE's factors
    # follow the engine's context length, so one file served at two lengths turns keys two
    # ways.
    rotary: str = ""

    @property
    def digest(self) -> bytes:
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()

    @property
    def name(self) -> str:
        """The tier's sub-directory for this fingerprint."""
        return self.digest.hex()


def weights_identity(path: str) -> str:
    """A content identity of a weights file or directory that costs ~1 MB of reads: sizes
    plus evenly spaced samples of every weights file (and the config, for a directory). A
    copy of the same file has the same identity; a re-quantized or re-trained one does not."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path)
                       if n.endswith((".safetensors", ".gguf", ".bin")) or n == "config.json")
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for file in files:
        size = os.path.getsize(file)
        digest.update(struct.pack("<Q", size))
        with open(file, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def chain_keys(fingerprint: bytes, namespace: bytes, tokens: Sequence[int], block_tokens: int,
               parents: Sequence[bytes] = ()) -> list[bytes]:
    """Keys of the full blocks of `tokens` in the namespace of those bytes (see the module
    docstring); `parents` are keys already computed for its first blocks (they are extended,
    not recomputed)."""
    ns_part = struct.pack("<I", len(namespace)) + namespace
    keys = list(parents)
    previous = keys[-1] if keys else fingerprint
    for start in range(len(keys) * block_tokens, len(tokens) - block_tokens + 1, block_tokens):
        block = struct.pack(f"<{block_tokens}I", *tokens[start : start + block_tokens])
        previous = hashlib.blake2b(previous + ns_part + block, digest_size=KEY_BYTES).digest()
        keys.append(previous)
    return keys
