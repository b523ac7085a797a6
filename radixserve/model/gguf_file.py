"""The GGUF file format: our own reader and the decoding of its tensors to float32.

`GGUFFile.open` maps the file read-only and parses the header, the metadata and the tensor
table; each tensor's quantized blocks stay in the map as a zero-copy numpy view. We read GGUF
ourselves because `gguf.GGUFReader` builds one numpy view per array element, which costs
seconds on a 49k-entry vocabulary, and because quantized kernels want the raw blocks anyway.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 used 32-bit lengths; v2 and v3 share one layout
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGMLType:
    """A tensor encoding: `block_size` weights are stored in `block_bytes` bytes."""

    id: int
    name: str
    block_size: int
    block_bytes: int


GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 40),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
        GGMLType(40, "NVFP4", 64, 36),
        GGMLType(41, "Q1_0", 128, 18),
    )
}

# Metadata value types (GGUF spec ids): scalar struct formats, and numpy dtypes for arrays.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_SCALAR_STRUCTS = {kind: struct.Struct(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_ARRAY_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in the file, with its bytes as a read-only view of the map."""

    name: str
    ggml_type: GGMLType
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (row) length
    offset: int  # from the start of the data section
    data: np.ndarray = field(repr=False)  # uint8, n_bytes long, a view of the map (no copy)

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def shape(self) -> tuple[int, ...]:
        """Numpy (row-major) order: GGUF's dims reversed, so rows = output features."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

    @property
    def n_bytes(self) -> int:
        return self.data.size


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file. The map stays open while any tensor view of it is alive."""

    path: Path
    version: int
    alignment: int
    data_offset: int  # absolute offset of the (aligned) tensor data section
    metadata: dict[str, Any]  # values as `gguf`'s ReaderField.contents() gives them
    tensors: dict[str, GGUFTensor]  # in file order

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        """Maps and parses `path`; raises ValueError naming the file if it is not valid GGUF."""
        path = Path(path)
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ValueError(f"{path}: empty file, not GGUF")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _Parser(path, buf).parse()
        except struct.error as exc:  # an unpack past the end that no bounds check caught
            raise ValueError(f"{path}: truncated GGUF file ({exc})") from None


class _Parser:
    """A cursor over the mapped bytes; every read checks that the file holds it."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                f"truncated GGUF file: {what} needs {n} bytes at offset {self.pos}, "
                f"file is {self.size} bytes"
            )

    def u32(self) -> int:
        self.need(4, "a uint32")
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        self.need(8, "a uint64")
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        n = self.u64()
        self.need(n, "a string")
        start, self.pos = self.pos, self.pos + n
        return self.decode(self.buf[start : self.pos])

    def decode(self, raw: bytes) -> str:
        # Strict UTF-8 as gguf's contents() does, but with an error that names the file.
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"invalid UTF-8 in a string at offset {self.pos}: {exc}") from None

    def value(self, kind: int) -> Any:
        scalar = _SCALAR_STRUCTS.get(kind)
        if scalar is not None:
            self.need(scalar.size, "a scalar value")
            (value,) = scalar.unpack_from(self.buf, self.pos)
            self.pos += scalar.size
            return value
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind = self.u32()
            count = self.u64()
            return self.array(item_kind, count)
        raise self.fail(f"unknown metadata value type {kind} at offset {self.pos - 4}")

    def array(self, kind: int, count: int) -> list[Any]:
        dtype = _ARRAY_DTYPES.get(kind)
        if dtype is not None:
            self.need(count * dtype.itemsize, f"an array of {count} numbers")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        if kind == _STRING:
            return self.string_array(count)
        # Nested arrays stay nested (gguf's contents() flattens them; no model we load has any).
        return [self.value(kind) for _ in range(count)]

    def string_array(self, count: int) -> list[str]:
        # The hot loop of the whole file (vocabularies and merges, ~100k strings): locals only.
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                end = pos + n
                if end > size:
                    break
                append(buf[pos:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError as exc:
            self.pos = pos
            raise self.fail(f"invalid UTF-8 in a string at offset {pos}: {exc}") from None
        self.pos = pos
        if len(out) < count:
            raise self.fail(f"truncated GGUF file: string array of {count} ends past the file")
        return out

    def parse(self) -> GGUFFile:
        self.need(4, "the magic")
        magic = bytes(self.buf[0:4])
        if magic != GGUF_MAGIC:
            raise self.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        self.pos = 4
        version = self.u32()
        if version not in GGUF_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in GGUF_VERSIONS:
                raise self.fail("big-endian GGUF files are not supported")
            raise self.fail(f"GGUF version {version} is not supported (supported: 2, 3)")
        tensor_count = self.u64()
        kv_count = self.u64()
        metadata: dict[str, Any] = {}
        alignment_kind = None
        for _ in range(kv_count):
            key = self.string()
            kind = self.u32()
            if key in metadata:
                raise self.fail(f"duplicate metadata key {key!r}")
            if key == "general.alignment":
                alignment_kind = kind
            metadata[key] = self.value(kind)
        alignment = DEFAULT_ALIGNMENT
        if alignment_kind is not None:
            alignment = metadata["general.alignment"]
            if alignment_kind != 4 or alignment == 0 or alignment & (alignment - 1):
                raise self.fail(f"general.alignment must be a uint32 power of two, got {alignment!r}")
        infos = [self.tensor_info() for _ in range(tensor_count)]
        data_offset = -(-self.pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, ggml_type, offset in infos:
            if name in tensors:
                raise self.fail(f"duplicate tensor {name!r}")
            tensors[name] = self.tensor(name, dims, ggml_type, offset, data_offset)
        return GGUFFile(self.path, version, alignment, data_offset, metadata, tensors)

    def tensor_info(self) -> tuple[str, tuple[int, ...], GGMLType, int]:
        name = self.string()
        n_dims = self.u32()
        self.need(8 * n_dims, f"the dims of tensor {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        self.pos += 8 * n_dims
        type_id = self.u32()
        ggml_type = GGML_TYPES.get(type_id)
        if ggml_type is None:
            raise self.fail(f"tensor {name!r} has unknown GGML type id {type_id}")
        return name, dims, ggml_type, self.u64()

    def tensor(
        self, name: str, dims: tuple[int, ...], ggml_type: GGMLType, offset: int, data_offset: int
    ) -> GGUFTensor:
        row = dims[0] if dims else 1
        if row % ggml_type.block_size:
            raise self.fail(
                f"tensor {name!r}: row length {row} is not a multiple of the "
                f"{ggml_type.name} block size {ggml_type.block_size}"
            )
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        n_bytes = n_elements // ggml_type.block_size * ggml_type.block_bytes
        start = data_offset + offset
        if start + n_bytes > self.size:
            raise self.fail(
                f"tensor {name!r} data [{start}, {start + n_bytes}) lies past the end of the "
                f"file ({self.size} bytes): truncated GGUF file"
            )
        data = np.frombuffer(self.buf, dtype=np.uint8, count=n_bytes, offset=start)
        return GGUFTensor(name, ggml_type, tuple(dims), offset, data)


# Decoders write blocks of this many into a preallocated output, so each chunk's intermediate
# arrays stay in cache instead of making several passes over the whole (large) tensor.
_CHUNK_BLOCKS = 8192


def _blocks(tensor: GGUFTensor) -> np.ndarray:
    return tensor.data.reshape(-1, tensor.ggml_type.block_bytes)


def _fp16_column(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian fp16 at byte `at` of each block, as a float32 column."""
    return blocks[:, at : at + 2].view("<f2").astype(np.float32)


def _decode_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # fp16 d, 32 int8 q: x = q * d
    np.multiply(blocks[:, 2:].view(np.int8), _fp16_column(blocks, 0), out=out)


def _decode_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # fp16 d, 16 bytes: weight j < 16 is the low nibble of byte j, j >= 16 the high nibble of
    # byte j - 16; x = (q - 8) * d. q - 8 is exact in float32, so this matches gguf bitwise.
    qs = blocks[:, 2:]
    np.bitwise_and(qs, 0x0F, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    out -= 8
    out *= _fp16_column(blocks, 0)


def _decode_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # fp16 d, fp16 m, 16 bytes of nibbles laid out as in Q4_0; x = d * q + m, rounded after the
    # product and again after the sum (no fused multiply-add), exactly as gguf computes it.
    qs = blocks[:, 4:]
    np.bitwise_and(qs, 0x0F, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    out *= _fp16_column(blocks, 0)
    out += _fp16_column(blocks, 2)


_BLOCK_DECODERS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "Q8_0": _decode_q8_0,
    "Q4_0": _decode_q4_0,
    "Q4_1": _decode_q4_1,
}


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as a new float32 torch tensor of shape `tensor.shape`.

    F32/F16/BF16 and Q8_0/Q4_0/Q4_1 are decoded here; other types go through
    `gguf.quants.dequantize`. Either way the result is bitwise what gguf gives. The values are
    written into memory from torch's allocator (64-byte aligned, where numpy's is 16): oneDNN
    runs a long prefill faster on such weights.
    """
    result = torch.empty(tensor.shape, dtype=torch.float32)
    flat = result.numpy().reshape(-1)
    kind = tensor.type_name
    if kind == "F32":
        flat[:] = tensor.data.view("<f4")
    elif kind == "F16":
        flat[:] = tensor.data.view("<f2")
    elif kind == "BF16":
        # bf16 is the top half of an f32: widening is a 16-bit shift, NaN payloads included.
        flat.view(np.uint32)[:] = tensor.data.view("<u2").astype(np.uint32) << 16
    elif kind in _BLOCK_DECODERS:
        decode = _BLOCK_DECODERS[kind]
        blocks = _blocks(tensor)
        out = flat.reshape(blocks.shape[0], tensor.ggml_type.block_size)
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            stop = start + _CHUNK_BLOCKS
            decode(blocks[start:stop], out[start:stop])
    else:
        flat[:] = _dequantize_with_gguf(tensor).reshape(-1)
    return result


def _dequantize_with_gguf(tensor: GGUFTensor) -> np.ndarray:
    import gguf

    row_bytes = tensor.dims[0] // tensor.ggml_type.block_size * tensor.ggml_type.block_bytes
    rows = tensor.data.reshape(-1, row_bytes)
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(tensor.ggml_type.id))
    # For plain element types gguf returns a view of our read-only map; torch needs our own.
    return np.array(values, dtype=np.float32, copy=True)
