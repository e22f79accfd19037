"""Our safetensors writer against the reference library, byte for byte, and a reader that refuses every
kind of damaged file with one clear error."""

import io
import json
import struct

import numpy as np
import pytest

from xtrain_dist.checkpoint.safetensors_io import encode_header, read_safetensors, write_safetensors
from xtrain_dist.errors import XtrainError

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def tensors():
    rng = np.random.default_rng(0)
    return {"transformer.wte.weight": rng.standard_normal((7, 3)).astype(np.float32),
            "b": rng.standard_normal(5).astype(np.float32),
            "a.bias": np.zeros(1, dtype=np.float32),
            "empty": np.zeros((0, 4), dtype=np.float32)}


def written(data, metadata=None) -> bytes:
    buf = io.BytesIO()
    write_safetensors(buf, data, metadata)
    return buf.getvalue()


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_the_writer_matches_the_reference_library_byte_for_byte(metadata):
    assert written(tensors(), metadata) == safetensors_numpy.save(tensors(), metadata=metadata)


def test_the_header_is_padded_so_the_data_starts_8_byte_aligned():
    for n in range(1, 12):
        header = encode_header({"x" * n: np.zeros(n, dtype=np.float32)})
        assert len(header) % 8 == 0 and struct.unpack("<Q", header[:8])[0] == len(header) - 8


def test_the_reader_reads_what_the_reference_library_writes(tmp_path):
    path = tmp_path / "ref.safetensors"
    mixed = {**tensors(), "ids": np.arange(6, dtype=np.int64).reshape(2, 3), "half": np.ones(3, np.float16)}
    safetensors_numpy.save_file(mixed, path, metadata={"format": "pt", "note": "x"})
    read, metadata = read_safetensors(path)
    assert metadata == {"format": "pt", "note": "x"}
    assert set(read) == set(mixed)
    for name, array in mixed.items():
        assert read[name].dtype == array.dtype and read[name].shape == array.shape
        np.testing.assert_array_equal(read[name], array)


def damaged(tmp_path, raw: bytes):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(XtrainError) as info:
        read_safetensors(path)
    prefix = f"'{path}' is not a valid safetensors file: "
    assert str(info.value).startswith(prefix)
    return str(info.value)[len(prefix):]


def with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_damaged_files_are_refused_by_name(tmp_path):
    good = written(tensors(), {"format": "pt"})
    assert damaged(tmp_path, good[:5]) == "it has 5 bytes, fewer than the 8 of the header length"
    assert damaged(tmp_path, good[:-4]) == "the header describes 108 bytes of data, the file holds 104 (truncated?)"
    assert damaged(tmp_path, good + b"\0") == "the header describes 108 bytes of data, the file holds 109 (truncated?)"
    assert damaged(tmp_path, struct.pack("<Q", 1 << 40) + good[8:]).startswith("its header length 1099511627776")
    # a length past the end of the file by a few bytes, far below the reference reader's 100 MiB limit
    assert damaged(tmp_path, struct.pack("<Q", len(good) - 5) + good[8:]) == \
        f"its header length {len(good) - 5} exceeds the {len(good) - 8} bytes after it"
    assert damaged(tmp_path, struct.pack("<Q", 3) + b"{x}").startswith("its header is not JSON")
    deep = b"[" * 100_000  # nested past Python's recursion limit
    assert damaged(tmp_path, struct.pack("<Q", len(deep)) + deep).startswith("its header is not JSON (nested too")
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    assert damaged(tmp_path, with_header({"a": {**entry, "shape": [3]}}, bytes(8))) == \
        "tensor 'a' of shape [3] F32 needs 12 bytes, its offsets hold 8"
    assert damaged(tmp_path, with_header({"a": entry, "b": {**entry, "data_offsets": [4, 12]}}, bytes(12))) == \
        "tensor 'b' starts at byte 4, expected 8 (a hole or an overlap)"
    assert damaged(tmp_path, with_header({"a": {**entry, "dtype": "Q7"}}, bytes(8))).startswith(
        "tensor 'a' has no valid dtype, shape and data_offsets")
    assert damaged(tmp_path, with_header({"a": {**entry, "shape": [-2]}}, bytes(8))).startswith(
        "tensor 'a' has a negative or non-integer shape or offset")
    assert damaged(tmp_path, with_header({"__metadata__": {"format": 1}, "a": entry}, bytes(8))) == \
        "__metadata__ is not a map of strings"
