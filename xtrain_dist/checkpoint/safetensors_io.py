"""A small safetensors writer and a checking reader, so the trainer needs no package beyond numpy.

The format (https://github.com/huggingface/safetensors): 8 bytes, the header's length N as a
little-endian u64; N bytes of UTF-8 JSON mapping each tensor name to {"dtype", "shape",
"data_offsets": [begin, end]} (byte offsets into the data that follows the header), plus an
optional "__metadata__" object of string -> string; then the data, every tensor little-endian and
C-ordered, the ranges tiling it without holes or overlaps.

The writer lays files out as the reference implementation does (compact JSON, metadata first,
tensors sorted by name, the header padded with spaces so that the data starts 8-byte aligned), so
for float32 tensors its bytes equal `safetensors.numpy.save(tensors, metadata)`'s. The reader
checks every number in the header against the file before using it: a truncated or damaged file
is one clear error, never a read out of bounds or a silently short tensor.
"""

import json
import struct

import numpy as np

from ..errors import XtrainError
from ..files import loads_json, read_regular

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(t): name for name, t in DTYPES.items()}
MAX_HEADER = 100 << 20  # the reference reader's limit


def encode_header(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the padded JSON header for `tensors` laid out in sorted-name order."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        array = tensors[name]
        if array.dtype not in _NAMES:
            raise TypeError(f"safetensors has no dtype for {array.dtype} ({name})")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(file, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` to the open binary `file` (the caller flushes, syncs and closes it)."""
    file.write(encode_header(tensors, metadata))
    for name in sorted(tensors):
        file.write(np.ascontiguousarray(tensors[name], dtype=tensors[name].dtype.newbyteorder("<")).data)


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of the file at `path`; the tensors are read-only views of its bytes."""
    try:
        data = read_regular(path)
    except OSError as err:
        raise XtrainError(f"cannot read '{path}' ({err.strerror or err})") from None
    return parse_safetensors(data, str(path))


def parse_safetensors(data: bytes, where: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a whole safetensors file held in `data`; `where` names it in errors."""

    def bad(reason: str) -> XtrainError:
        return XtrainError(f"'{where}' is not a valid safetensors file: {reason}")

    size = len(data)
    if size < 8:
        raise bad(f"it has {size} bytes, fewer than the 8 of the header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER, size - 8):
        raise bad(f"its header length {n} exceeds the {size - 8} bytes after it")
    try:
        header = loads_json(data[8: 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not a map of strings")

    data_start, data_len = 8 + n, size - 8 - n
    ranges, tensors = [], {}
    for name, entry in header.items():
        try:
            dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor '{name}' has no valid dtype, shape and data_offsets: {entry}") from None
        if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
            raise bad(f"tensor '{name}' has a negative or non-integer shape or offset: {entry}")
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise bad(f"tensor '{name}' of shape {list(shape)} {entry['dtype']} needs {count * dtype.itemsize} "
                      f"bytes, its offsets hold {end - begin}")
        ranges.append((begin, end, name))
        tensors[name] = (dtype, shape, count, begin)
    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            raise bad(f"tensor '{name}' starts at byte {begin}, expected {covered} (a hole or an overlap)")
        covered = end
    if covered != data_len:
        raise bad(f"the header describes {covered} bytes of data, the file holds {data_len} (truncated?)")
    arrays = {name: np.frombuffer(data, dtype=dtype, count=count, offset=data_start + begin).reshape(shape)
              for name, (dtype, shape, count, begin) in tensors.items()}
    return arrays, metadata
