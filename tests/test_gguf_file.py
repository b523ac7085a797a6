"""Our GGUF reader against the `gguf` package: the same metadata and tensor table on the default
model, bitwise-equal dequantization per tensor type on small files written with gguf's writer,
hand-built blocks decoded per the format's definition, and clear errors on broken files."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve.model.gguf_file import GGML_TYPES, GGUFFile, dequantize

pytestmark = [pytest.mark.model]

gguf = pytest.importorskip("gguf")

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def default_files(model_path) -> tuple[GGUFFile, object]:
    # gguf's reader takes seconds on this file: parse it once for every test here.
    return GGUFFile.open(model_path), gguf.GGUFReader(str(model_path))


def test_default_model_metadata_matches_gguf_reader(default_files):
    ours, reader = default_files
    theirs = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    assert list(ours.metadata) == list(theirs)
    for key, value in theirs.items():
        # Equal and of the same Python types (1 == 1.0 == True would hide a wrong decoding).
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in ours.metadata[key]} == {type(v) for v in value}, key
    assert ours.version == reader.fields["GGUF.version"].contents()
    assert ours.alignment == reader.alignment
    assert ours.data_offset == reader.data_offset


def test_default_model_tensor_table_matches_gguf_reader(default_files):
    ours, reader = default_files
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for expected in reader.tensors:
        tensor = ours.tensors[expected.name]
        assert tensor.dims == tuple(int(d) for d in expected.shape)
        assert tensor.shape == tuple(reversed(tensor.dims))
        assert tensor.ggml_type.id == int(expected.tensor_type)
        assert tensor.type_name == expected.tensor_type.name
        assert ours.data_offset + tensor.offset == expected.data_offset
        assert tensor.n_bytes == expected.n_bytes
        assert tensor.n_elements == expected.n_elements
        # A read-only view of the map, not a copy, holding the same bytes.
        assert tensor.data.dtype == np.uint8 and not tensor.data.flags.owndata
        assert not tensor.data.flags.writeable
        assert np.array_equal(tensor.data, expected.data.reshape(-1).view(np.uint8))


def test_type_table_matches_gguf():
    for type_id, ggml_type in GGML_TYPES.items():
        assert Q(type_id).name == ggml_type.name
        assert gguf.GGML_QUANT_SIZES[Q(type_id)] == (ggml_type.block_size, ggml_type.block_bytes)


def _write(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, object]],
    metadata: dict[str, tuple[object, object]] | None = None,
    alignment: int | None = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)  # the key, and the data laid out to match
    for key, (kind, value) in (metadata or {}).items():
        writer.add_key_value(key, value, kind)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, object]]:
    """One tensor per type, odd row counts, with an all-zero row and a constant row (scale 0)."""
    def values(rows: int, cols: int) -> np.ndarray:
        x = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        x[1] = 0.0
        x[2] = 0.25
        return x

    tensors: dict[str, tuple[np.ndarray, object]] = {
        "f32": (values(5, 48), None),
        "f16": (values(7, 40).astype(np.float16), None),
        "bf16": (gguf.quants.quantize(values(7, 40), Q.BF16), Q.BF16),
    }
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        tensors[kind.name.lower()] = (gguf.quants.quantize(values(7, 96), kind), kind)
    # gguf cannot quantize K-quants; random blocks with a small fp16 scale exercise the fallback.
    q6 = rng.integers(0, 256, (3, 210), dtype=np.uint8)
    q6[:, 208:] = np.full((3, 1), 0.01, dtype=np.float16).view(np.uint8)
    tensors["q6_k"] = (q6, Q.Q6_K)
    return tensors


def test_dequantize_is_bitwise_equal_to_gguf(tmp_path):
    path = _write(tmp_path / "types.gguf", _random_tensors(np.random.default_rng(0)))
    ours = GGUFFile.open(path)
    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == len(ours.tensors) == 9
    for expected in reader.tensors:
        tensor = ours.tensors[expected.name]
        assert tensor.type_name == expected.name.upper()
        got = dequantize(tensor)
        want = np.asarray(gguf.quants.dequantize(expected.data, expected.tensor_type), np.float32)
        assert got.dtype == torch.float32
        assert tuple(got.shape) == want.shape == tensor.shape, expected.name
        assert got.numpy().tobytes() == want.tobytes(), expected.name


def test_hand_built_blocks_decode_per_the_format(tmp_path):
    # An oracle independent of gguf: weight j < 16 is the low nibble of byte j, weight j >= 16
    # the high nibble of byte j - 16. Low and high nibbles differ in every byte, so a decoder
    # that swaps them (or interleaves them) fails here.
    nibbles = np.arange(16, dtype=np.uint8) | ((15 - np.arange(16, dtype=np.uint8)) << 4)
    q = np.concatenate([np.arange(16), 15 - np.arange(16)]).astype(np.float32)
    half = np.array([0.5], dtype=np.float16).view(np.uint8)
    minus_two = np.array([-2.0], dtype=np.float16).view(np.uint8)
    q8 = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    blocks = {
        "q4_1": (np.concatenate([half, minus_two, nibbles])[None], Q.Q4_1),
        "q4_0": (np.concatenate([half, nibbles])[None], Q.Q4_0),
        "q8_0": (np.concatenate([minus_two, q8])[None], Q.Q8_0),
    }
    ours = GGUFFile.open(_write(tmp_path / "blocks.gguf", blocks))
    assert dequantize(ours.tensors["q4_1"]).tolist() == [(0.5 * q - 2.0).tolist()]
    assert dequantize(ours.tensors["q4_0"]).tolist() == [(0.5 * (q - 8)).tolist()]
    assert dequantize(ours.tensors["q8_0"]).tolist() == [(-2.0 * np.arange(-16, 16)).tolist()]
    assert dequantize(ours.tensors["q4_1"])[0, 1].item() == -1.5  # low nibble of byte 1 is 1
    assert dequantize(ours.tensors["q4_1"])[0, 17].item() == 5.0  # high nibble of byte 1 is 14


def test_metadata_value_types_and_alignment(tmp_path):
    V = gguf.GGUFValueType
    metadata = {
        "t.u8": (V.UINT8, 255), "t.i8": (V.INT8, -128), "t.u16": (V.UINT16, 65535),
        "t.i16": (V.INT16, -32768), "t.u32": (V.UINT32, 2**32 - 1), "t.i32": (V.INT32, -(2**31)),
        "t.u64": (V.UINT64, 2**64 - 1), "t.i64": (V.INT64, -(2**63)), "t.f32": (V.FLOAT32, 0.1),
        "t.f64": (V.FLOAT64, 0.1), "t.bool": (V.BOOL, True), "t.str": (V.STRING, "héllo ✓"),
        "t.floats": (V.ARRAY, [0.5, -1.25, 3.0]), "t.bools": (V.ARRAY, [True, False]),
        "t.strs": (V.ARRAY, ["", "a", "ünï"]), "t.nested": (V.ARRAY, [[1, 2], [3]]),
    }
    tensors = {"a": (np.arange(3, dtype=np.float32), None), "b": (np.ones(5, np.float32), None)}
    path = _write(tmp_path / "meta.gguf", tensors, metadata, alignment=64)
    ours = GGUFFile.open(path)
    reader = gguf.GGUFReader(str(path))
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if name == "t.nested":
            # We keep nested arrays nested; gguf's contents() flattens them.
            assert ours.metadata[name] == [[1, 2], [3]]
            assert [v for inner in ours.metadata[name] for v in inner] == field.contents()
        else:
            assert ours.metadata[name] == field.contents(), name
            assert type(ours.metadata[name]) is type(field.contents()), name
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    assert ours.tensors["b"].offset % 64 == 0
    assert dequantize(ours.tensors["b"]).tolist() == [1.0] * 5


def _small_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "small.gguf", {"w": (np.ones((3, 32), np.float32), None)})


def _raises(path: Path, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
        GGUFFile.open(path)


def test_truncated_files_raise(tmp_path):
    raw = _small_file(tmp_path).read_bytes()
    for cut in (2, 10, 30, len(raw) // 2, len(raw) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(raw[:cut])
        _raises(path, "(truncated|not a GGUF)")
    # Cutting into the tensor data names the tensor that lies past the end.
    path = tmp_path / "cut_data.gguf"
    path.write_bytes(raw[:-4])
    _raises(path, "tensor 'w' data .* past the end")


def test_bad_header_fields_raise(tmp_path):
    raw = _small_file(tmp_path).read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGML" + raw[4:])
    _raises(bad_magic, "not a GGUF file")

    version_1 = tmp_path / "v1.gguf"
    version_1.write_bytes(raw[:4] + struct.pack("<I", 1) + raw[8:])
    _raises(version_1, "version 1 is not supported")

    # v2 has the same layout as v3 and is read alike.
    version_2 = tmp_path / "v2.gguf"
    version_2.write_bytes(raw[:4] + struct.pack("<I", 2) + raw[8:])
    assert GGUFFile.open(version_2).version == 2

    # The type id follows the name, n_dims (2) and the two dims of the tensor info.
    at = raw.index(b"\x01\x00\x00\x00\x00\x00\x00\x00w") + 9 + 4 + 16
    assert struct.unpack_from("<I", raw, at)[0] == 0  # F32
    unknown_type = tmp_path / "type.gguf"
    unknown_type.write_bytes(raw[:at] + struct.pack("<I", 99) + raw[at + 4 :])
    _raises(unknown_type, "tensor 'w' has unknown GGML type id 99")

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _raises(empty, "empty file")
