"""A float GGUF's copy with its matrices in quantized blocks (gguf-py's quantizer, ggml's
reference rounding), as llama-quantize writes one. The metadata is copied as its bytes:
rebuilding ~100k vocabulary entries through gguf-py's reader and writer cost more than all
the rest of a tiny model's copy."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from radixserve.model.gguf_file import GGUFFile, GGUFTensor

# GGUF metadata value types (spec ids): the byte size of each scalar; 8 string, 9 array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count


def requantize_gguf(source: Path, outfile: Path, type_name: str) -> Path:
    """A copy of `source` whose matrices and 3-D expert stacks are `type_name` blocks; norms,
    biases and routers stay float32, as llama-quantize leaves them."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    model = GGUFFile.open(source)
    raw = source.read_bytes()
    _, version, _, kv_count = _HEADER.unpack_from(raw)
    metadata = raw[_HEADER.size:_metadata_end(raw, kv_count)]
    tensors = [(tensor.name, _requantized(tensor, qtype)) for tensor in model.tensors.values()]
    with open(outfile, "wb") as out:
        out.write(_HEADER.pack(b"GGUF", version, len(tensors), kv_count) + metadata)
        offset = 0
        for name, (dims, type_id, data) in tensors:
            encoded = name.encode()
            out.write(struct.pack(f"<Q{len(encoded)}sI{len(dims)}QIQ", len(encoded), encoded,
                                  len(dims), *dims, type_id, offset))
            offset += _padded(data.nbytes, model.alignment)
        out.write(bytes(_padded(out.tell(), model.alignment) - out.tell()))
        for _, (_, _, data) in tensors:
            out.write(data.tobytes())
            out.write(bytes(_padded(data.nbytes, model.alignment) - data.nbytes))
    return outfile


def _requantized(tensor: GGUFTensor, qtype) -> tuple[tuple[int, ...], int, np.ndarray]:
    """(GGUF dims, type id, bytes) of the tensor in the copy."""
    if tensor.type_name != "F32":
        return tensor.dims, tensor.ggml_type.id, tensor.data
    values = tensor.data.view("<f4").reshape(tensor.shape)
    if (values.ndim >= 2 and values.shape[-1] % 32 == 0
            and not tensor.name.endswith((".bias", "ffn_gate_inp.weight"))):
        import gguf

        return tensor.dims, int(qtype), gguf.quants.quantize(values, qtype)
    return tensor.dims, tensor.ggml_type.id, tensor.data


def _metadata_end(raw: bytes, kv_count: int) -> int:
    """Where the metadata section ends (the tensor table starts)."""
    pos = _HEADER.size
    for _ in range(kv_count):
        (key_bytes,) = struct.unpack_from("<Q", raw, pos)
        pos += 8 + key_bytes
        (kind,) = struct.unpack_from("<I", raw, pos)
        pos = _skip_value(raw, pos + 4, kind)
    return pos


def _skip_value(raw: bytes, pos: int, kind: int) -> int:
    if kind in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[kind]
    if kind == _STRING:
        (length,) = struct.unpack_from("<Q", raw, pos)
        return pos + 8 + length
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF metadata type {kind} at byte {pos}")
    item_kind, count = struct.unpack_from("<IQ", raw, pos)
    pos += 12
    if item_kind in _SCALAR_BYTES:
        return pos + count * _SCALAR_BYTES[item_kind]
    for _ in range(count):
        pos = _skip_value(raw, pos, item_kind)
    return pos


def _padded(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment
