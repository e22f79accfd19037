"""llm.c's token files, read where they lie: their header, the windows a batch takes from a stream stored in
them, and the bytes of a new one (xtrain-tokenize)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import XtrainError
from ..files import NotRegularFile, check_regular, reading

# llm.c (dev/data/data_common.py) keeps a tokenized dataset as files of a header of 256 little-endian
# int32 (magic, version, number of ids, zeros) followed by the ids; FineWeb, TinyStories and its
# tinyshakespeare come as such files, the large ones in shards of 100M ids. A run reads them as they are,
# so it trains on the very tokens llm.c trains on, and on a dataset larger than memory: a batch reads only
# the windows it draws, and the one pass over everything at the start (the vocabulary check and the
# digest) reads block by block.
TOKEN_FILE_HEADER_BYTES = 256 * 4
TOKEN_FILE_FORMATS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}  # magic: (version, ids)
MAX_TOKEN_FILE_IDS = 2**31 - 1  # the header holds the count as an int32
_READ_BLOCK_IDS = 1 << 22


@dataclass(frozen=True)
class _Span:
    """`count` ids of one token file, from its id `first` on."""

    path: Path
    dtype: np.dtype
    first: int
    count: int

    def read(self, lo: int, n: int) -> np.ndarray:
        """Ids lo .. lo + n - 1 of the span (a positioned read: no memory map grows with the run)."""
        with open(self.path, "rb") as f:
            f.seek(TOKEN_FILE_HEADER_BYTES + (self.first + lo) * self.dtype.itemsize)
            ids = np.fromfile(f, dtype=self.dtype, count=n)
        if len(ids) != n:
            raise XtrainError(f"token file '{self.path}' was cut short while this run read it")
        return ids

    def blocks(self):
        for lo in range(0, self.count, _READ_BLOCK_IDS):
            yield self.read(lo, min(_READ_BLOCK_IDS, self.count - lo))


class TokenFiles:
    """One token stream stored in token files, one after another: the length, the windows a batch takes,
    and a split into train and validation, none of which reads the stream into memory."""

    def __init__(self, spans: list[_Span]):
        self.spans = [s for s in spans if s.count]
        self._ends = np.cumsum([s.count for s in self.spans], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if self.spans else 0

    def split(self, n: int) -> tuple[TokenFiles, TokenFiles]:
        """The first n ids and the rest."""
        head, tail, start = [], [], 0
        for s in self.spans:
            cut = min(max(n - start, 0), s.count)
            head.append(replace(s, count=cut))
            tail.append(replace(s, first=s.first + cut, count=s.count - cut))
            start += s.count
        return TokenFiles(head), TokenFiles(tail)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 (len(starts), length): ids s .. s + length - 1 for each s, across file ends where a window
        straddles one."""
        out = np.empty((len(starts), length), dtype=np.int32)
        for row, start in enumerate(np.asarray(starts).tolist()):
            k = int(np.searchsorted(self._ends, start, side="right"))
            col = 0
            while col < length:
                span = self.spans[k]
                lo = start + col - (int(self._ends[k]) - span.count)
                n = min(length - col, span.count - lo)
                out[row, col:col + n] = span.read(lo, n)
                col, k = col + n, k + 1
        return out


def take_windows(tokens: np.ndarray | TokenFiles, starts: np.ndarray, length: int) -> np.ndarray:
    """int32 (len(starts), length): the windows tokens[s : s + length] of a stream, in memory or in files."""
    if isinstance(tokens, TokenFiles):
        return tokens.windows(starts, length)
    return tokens[np.asarray(starts)[:, None] + np.arange(length)].astype(np.int32)


def token_file_chunks(ids: np.ndarray, vocab_size: int) -> list:
    """The bytes of an llm.c token file holding `ids`, as [header, ids] for files.write_atomic: version 1
    (uint16 ids, GPT-2's format) for a vocabulary of up to 65536 ids, else version 7 (uint32)."""
    if len(ids) > MAX_TOKEN_FILE_IDS:
        raise XtrainError(f"{len(ids)} ids are more than one llm.c token file counts ({MAX_TOKEN_FILE_IDS}): "
                          "split the text")
    magic = 20240520 if vocab_size <= 65536 else 20240801
    version, dtype = TOKEN_FILE_FORMATS[magic]
    header = np.zeros(TOKEN_FILE_HEADER_BYTES // 4, dtype="<i4")
    header[:3] = magic, version, len(ids)
    return [header.tobytes(), np.ascontiguousarray(ids, dtype=dtype)]


def _is_token_file(path: Path) -> bool:
    try:
        check_regular(path)  # a named pipe would block the open, whatever reads it next
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:  # unreadable: reading it as text says why
        return False
    return len(magic) == 4 and int.from_bytes(magic, "little", signed=True) in TOKEN_FILE_FORMATS


def _meant_as_token_file(path: Path) -> bool:
    """Whether `path` is meant as a token file even where its magic is not one we know (a header damaged or
    of another format): llm.c names them .bin, and their header ends in 253 zero int32, which no text has.
    Read as a token file, it is refused naming its header, not as "not UTF-8 text"."""
    if path.suffix == ".bin":
        return True
    try:
        check_regular(path)
        with open(path, "rb") as f:
            header = f.read(TOKEN_FILE_HEADER_BYTES)
    except OSError:
        return False
    return len(header) == TOKEN_FILE_HEADER_BYTES and not any(header[12:])


def _open_token_file(what: str, path: Path) -> _Span:
    with reading(what, path), open(path, "rb") as f:
        header, size = f.read(TOKEN_FILE_HEADER_BYTES), os.fstat(f.fileno()).st_size
    if len(header) < TOKEN_FILE_HEADER_BYTES:
        raise XtrainError(f"{what} '{path}' is not an llm.c token file (shorter than its "
                          f"{TOKEN_FILE_HEADER_BYTES}-byte header)")
    magic, version, count = (int(v) for v in np.frombuffer(header, dtype="<i4", count=3))
    if magic not in TOKEN_FILE_FORMATS:
        known = " or ".join(str(m) for m in TOKEN_FILE_FORMATS)
        raise XtrainError(f"{what} '{path}' is not an llm.c token file (magic {magic}, not {known})")
    want, dtype = TOKEN_FILE_FORMATS[magic]
    if version != want:
        raise XtrainError(f"{what} '{path}' is an llm.c token file of version {version}; with magic {magic} this "
                          f"trainer reads version {want}")
    expected = TOKEN_FILE_HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        raise XtrainError(f"{what} '{path}' is not a whole llm.c token file: its header counts {count} ids "
                          f"({expected} bytes with the header), the file has {size} bytes")
    return _Span(path, dtype, 0, count)


def open_token_files(what: str, given: Path) -> TokenFiles | None:
    """The token files `given` names (one file, or a glob pattern of several, taken in name order), or
    None where it names something else (a text file, or nothing: reading it as text says which)."""
    if given.is_file():  # a file's own name is never a pattern, even with a * in it
        if _is_token_file(given) or _meant_as_token_file(given):
            return TokenFiles([_open_token_file(what, given)])
        return None
    if not glob.has_magic(str(given)):
        return None
    matches = sorted(Path(p) for p in glob.glob(str(given)))
    if not matches:
        raise XtrainError(f"{what} '{given}' matches no file")
    for path in matches:
        try:
            check_regular(path)
        except NotRegularFile as err:
            raise XtrainError(f"{what} '{given}' matches '{path}', which is {err.strerror}") from None
        if not _is_token_file(path):
            raise XtrainError(f"{what} '{given}' matches '{path}', which is not an llm.c token file (a pattern "
                              "names token files only)")
    return TokenFiles([_open_token_file(what, path) for path in matches])
