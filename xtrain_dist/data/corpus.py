"""Text to token ids, and token ids to the batches each data-parallel rank trains on.

`Corpus` encodes a UTF-8 text file with any `tokenizers` JSON file, caches the ids on disk and keeps
the last part of the stream for validation; or it reads ids already made, from llm.c's token files
(`TokenFiles`), without loading them into memory. `BatchSampler` cuts random windows from a stream: every
rank draws the whole global batch from the same seeded RNG and keeps its own share, so the ranks
agree on the batch without talking to each other.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import itertools
import os
import re
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import tokenizers

from xtrain_dist import files
from xtrain_dist.errors import XtrainError, first_line

REPO_DATA = Path(__file__).resolve().parents[2] / "data"
DEFAULT_TOKENIZER = REPO_DATA / "tokenizer.json"
DEFAULT_CORPUS = REPO_DATA / "shakespeare.txt"

# Part of every cache key: change it whenever the same files would encode to different ids
# (a new way of splitting the text, say), so that stale caches stop matching.
_CACHE_FORMAT = b"xtrain-dist token ids v2"

# Where text is cut into independently encoded pieces: before the last newline of a run that ends a
# blank line and is followed by text ("...ink;\n" | "\nSIR TOBY."). See _encode_text.
_PARAGRAPH_BREAK = re.compile(r"(?<=\n)(?=\n\S)")
# Paragraphs per encode_batch call: enough to keep every core busy, few enough to keep the Encodings small.
_ENCODE_GROUP = 1024


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """What a stream of ids of this vocabulary is kept in (and a token file stores)."""
    return np.uint16 if vocab_size <= 65536 else np.uint32


def _read_file(what: str, path: Path) -> bytes:
    with files.reading(what, path):
        return path.read_bytes()


def _parse_tokenizer(path: Path, raw: bytes) -> tokenizers.Tokenizer:
    try:
        tokenizer = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise XtrainError(f"tokenizer '{path}' is not a tokenizers JSON file (not UTF-8 text)") from None
    except Exception as err:  # the Rust side raises a bare Exception with serde's reason
        raise XtrainError(f"tokenizer '{path}' is not a tokenizers JSON file ({first_line(err)})") from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < 2:  # none makes every corpus look empty; one makes every loss 0 from the first step
        raise XtrainError(f"tokenizer '{path}' has {vocab_size} token{'' if vocab_size == 1 else 's'} in its "
                          "vocabulary: a language model needs at least 2 to choose between")
    # A tokenizer.json saved for fine-tuning may truncate to 512 tokens or pad; we want every token.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def read_tokenizer(path) -> tokenizers.Tokenizer:
    """The tokenizers JSON file at `path`, or one XtrainError naming what is wrong with it."""
    return _parse_tokenizer(Path(path), _read_file("tokenizer", Path(path)))


def _encode_text(tokenizer: tokenizers.Tokenizer, text: str) -> np.ndarray:
    """All ids of `text` (int64), without the tokenizer's [CLS]/[SEP]-style post-processing.

    One `encode` of the 4.8 MB corpus takes about 5 s on one core; `encode_batch` over its 38k
    paragraphs takes about 1.6 s on two. The pieces are cut only where the byte-level (GPT-2) and
    whitespace-splitting pre-tokenizers cut anyway, so those give the same ids as one `encode` of the
    whole text. A tokenizer that marks the start of each input (SentencePiece's Metaspace) gets a
    mark at each paragraph instead: different ids, but still the same ones on every run.

    The paragraphs go to `encode_batch` a group at a time: an Encoding keeps each token's string, offsets
    and masks beside its id, about 170 bytes a token, so encoding the whole corpus at once held 0.27 GiB
    for 1.6M ids (6 MiB as uint32), and was the peak of a small run's memory.
    """
    paragraphs = _PARAGRAPH_BREAK.split(text)
    groups = []
    for lo in range(0, len(paragraphs), _ENCODE_GROUP):
        encodings = tokenizer.encode_batch(paragraphs[lo:lo + _ENCODE_GROUP], add_special_tokens=False)
        groups.append(np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64))
    return np.concatenate(groups)


def encode_checked(tokenizer: tokenizers.Tokenizer, text: str, tokenizer_path, source: str) -> np.ndarray:
    """The ids of `text` (_encode_text) in token_dtype, or one XtrainError naming the tokenizer and `source`
    (what the text is, as a message says it): the tokenizer failed on it, or made an id outside its
    vocabulary, which would read outside the embedding table."""
    try:
        ids = _encode_text(tokenizer, text)
    except Exception as err:  # e.g. a WordLevel model without an unknown token meets a new word
        raise XtrainError(f"tokenizer '{tokenizer_path}' cannot encode {source} ({first_line(err)})") from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if ids.size and ids.max() >= vocab_size:
        raise XtrainError(f"tokenizer '{tokenizer_path}' produced id {ids.max()}, outside its vocabulary of "
                          f"{vocab_size}")
    return ids.astype(token_dtype(vocab_size))


def _default_cache_dir() -> Path | None:
    if os.environ.get("XTRAIN_CACHE"):
        return Path(os.environ["XTRAIN_CACHE"])
    try:
        return Path.home() / ".cache" / "xtrain-dist"
    except RuntimeError:  # no home directory to be found: run without a cache
        return None


def _ids_digest(ids: np.ndarray) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(ids.tobytes()).digest(), dtype=np.uint8)


def _load_cached(path: Path, dtype: type[np.unsignedinteger]) -> np.ndarray | None:
    """The cached ids, or None for a file that is absent or not exactly what _save_cached wrote: the ids
    carry their sha256, because a damaged or edited cache would otherwise train on another stream (or
    fail later with an error that blames the corpus)."""
    try:
        with np.load(path, allow_pickle=False) as cached:
            ids, digest = cached["ids"], cached["sha256"]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):  # absent, unreadable, not ours
        return None
    if ids.ndim != 1 or ids.dtype != dtype or not np.array_equal(digest, _ids_digest(ids)):
        return None
    return ids


def _save_cached(path: Path, ids: np.ndarray) -> None:
    """Write `ids` so that a concurrent reader sees the whole file or none (files.write_atomic); a cache
    that cannot be written only makes the next load encode afresh, so the failure is ignored."""
    encoded = io.BytesIO()
    np.savez(encoded, ids=ids, sha256=_ids_digest(ids))
    with contextlib.suppress(XtrainError):
        files.write_atomic(path, encoded.getvalue(), "token cache")


def _encode_file(what: str, path: Path, tokenizer: tokenizers.Tokenizer, tokenizer_path: Path,
                 tokenizer_bytes: bytes, cache_dir: Path | None) -> np.ndarray:
    """The ids of the UTF-8 text file `path` (read-only), from the cache or encoded and cached."""
    corpus_bytes = _read_file(what, path)
    try:
        text = corpus_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise XtrainError(f"{what} '{path}' is not UTF-8 text") from None
    if not text.strip():
        raise XtrainError(f"{what} '{path}' is empty")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    key = hashlib.sha256(
        _CACHE_FORMAT + hashlib.sha256(tokenizer_bytes).digest() + hashlib.sha256(corpus_bytes).digest()
    ).hexdigest()
    cache_path = cache_dir / f"tokens-{key}.npz" if cache_dir is not None else None

    ids = _load_cached(cache_path, dtype) if cache_path is not None else None
    if ids is None:
        ids = encode_checked(tokenizer, text, tokenizer_path, f"{what} '{path}'")
        if cache_path is not None:
            _save_cached(cache_path, ids)
    ids.setflags(write=False)  # slices inherit this: no one can scribble on the shared stream
    return ids


# ------------------------------------------------------------------ token files (llm.c's format)

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


def text_blocks(f, block_chars: int = 1 << 24):
    """The text read from `f` (opened with newline="", as Corpus.load reads bytes) in blocks of about
    `block_chars`, each cut at its last paragraph break, where _encode_text cuts the whole text anyway:
    encoding the blocks one by one gives the ids of one _encode_text of all of it, without holding all of it."""
    rest = ""
    while chunk := f.read(block_chars):
        text = rest + chunk
        # a break needs the character after it, so one found here is a break of the whole text too
        cut = max((m.start() for m in _PARAGRAPH_BREAK.finditer(text)), default=0)
        if cut:
            yield text[:cut]
        rest = text[cut:]
    if rest:
        yield rest


def _is_token_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:  # unreadable: reading it as text says why
        return False
    return len(magic) == 4 and int.from_bytes(magic, "little", signed=True) in TOKEN_FILE_FORMATS


def _open_token_file(what: str, path: Path) -> _Span:
    with files.reading(what, path), open(path, "rb") as f:
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


def _token_files(what: str, given: Path) -> TokenFiles | None:
    """The token files `given` names (one file, or a glob pattern of several, taken in name order), or
    None where it names something else (a text file, or nothing: reading it as text says which)."""
    if given.is_file():  # a file's own name is never a pattern, even with a * in it
        return TokenFiles([_open_token_file(what, given)]) if _is_token_file(given) else None
    if not glob.has_magic(str(given)):
        return None
    matches = sorted(Path(p) for p in glob.glob(str(given)))
    if not matches:
        raise XtrainError(f"{what} '{given}' matches no file")
    for path in matches:
        if not _is_token_file(path):
            raise XtrainError(f"{what} '{given}' matches '{path}', which is not an llm.c token file (a pattern "
                              "names token files only)")
    return TokenFiles([_open_token_file(what, path) for path in matches])


def _stream_sha256(tokens: np.ndarray | TokenFiles, dtype, vocab_size: int, tokenizer_path: Path) -> str:
    """sha256 of the ids as `dtype`, the type a text corpus's ids are kept in, so the same ids have the same
    digest whichever kind of file they came from (a checkpoint of a run on a text resumes on the token
    file of its ids). Token files' ids are checked against the vocabulary on the way: an id past it would
    read outside the embedding table."""
    if isinstance(tokens, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(tokens)).hexdigest()
    digest = hashlib.sha256()
    for span in tokens.spans:
        for block in span.blocks():
            if block.max() >= vocab_size:
                raise XtrainError(f"token file '{span.path}' holds id {block.max()}, outside the {vocab_size} ids of "
                                  f"tokenizer '{tokenizer_path}': were its tokens made with another tokenizer?")
            digest.update(block.astype(dtype, copy=False))
    return digest.hexdigest()


@dataclass(eq=False)
class Corpus:
    """A tokenizer and a stream of token ids, split into train and validation streams.

    The ids come from a text file (encoded here and cached) or from llm.c token files (read where they
    lie); validation is the stream's last part, or a file of its own (`val_path`)."""

    tokenizer: tokenizers.Tokenizer = field(repr=False)
    vocab_size: int
    train: np.ndarray | TokenFiles = field(repr=False)
    val: np.ndarray | TokenFiles = field(repr=False)
    tokenizer_path: Path
    corpus_path: Path
    val_path: Path | None = None
    # the ids' sha256 (_stream_sha256): what checkpoints and the processes of a job compare
    train_sha256: str = ""
    val_sha256: str = ""

    @classmethod
    def load(cls, tokenizer_path, corpus_path, val_fraction: float = 0.1, cache_dir=None, val_path=None) -> Corpus:
        """The ids of `corpus_path`: a text file encoded with `tokenizer_path` (or its ids cached from an
        earlier load), an llm.c token file, or a glob pattern of token files taken in name order. The last
        `val_fraction` of them is held out for validation, or with `val_path`, that file (text or tokens)
        is, and the whole corpus trains.

        The cache file is named by the sha256 of both files' bytes, so editing either one, or
        swapping them, never reuses stale ids. It lives in `cache_dir`, else $XTRAIN_CACHE, else
        ~/.cache/xtrain-dist; if that cannot be written, every load encodes afresh.
        """
        if not 0 <= val_fraction < 1:
            raise XtrainError(f"val_fraction must be in [0, 1), got {val_fraction}")
        tokenizer_path, corpus_path = Path(tokenizer_path), Path(corpus_path)
        tokenizer_bytes = _read_file("tokenizer", tokenizer_path)
        tokenizer = _parse_tokenizer(tokenizer_path, tokenizer_bytes)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()

        def ids_of(what: str, path: Path) -> np.ndarray | TokenFiles:
            ids = _token_files(what, path)
            if ids is None:
                ids = _encode_file(what, path, tokenizer, tokenizer_path, tokenizer_bytes, cache_dir)
            if len(ids) == 0:
                raise XtrainError(f"{what} '{path}' is empty")
            return ids

        ids = ids_of("corpus", corpus_path)
        if val_path is None:
            n_train = len(ids) - int(len(ids) * val_fraction)
            train, val = ids.split(n_train) if isinstance(ids, TokenFiles) else (ids[:n_train], ids[n_train:])
        else:
            val_path = Path(val_path)
            # the same path (python -m xtrain_dist.evaluate DIR CORPUS holds all of CORPUS out): one read
            train, val = ids, ids if val_path == corpus_path else ids_of("validation corpus", val_path)
        dtype = token_dtype(vocab_size)
        train_sha256 = _stream_sha256(train, dtype, vocab_size, tokenizer_path)
        val_sha256 = train_sha256 if val is train else _stream_sha256(val, dtype, vocab_size, tokenizer_path)
        return cls(tokenizer, vocab_size, train, val, tokenizer_path, corpus_path, val_path, train_sha256, val_sha256)

    @property
    def val_source(self) -> str:
        """Where the validation ids come from, as an error message names it."""
        if self.val_path is None:
            return f"the validation split of corpus '{self.corpus_path}'"
        return f"validation corpus '{self.val_path}'"

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as int32, cut and encoded exactly as the corpus was."""
        return encode_checked(self.tokenizer, text, self.tokenizer_path, "the text").astype(np.int32)

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens included, so that decode(encode(t)) == t for byte-level BPE."""
        ids = np.asarray(ids, dtype=np.int64).ravel().tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_seq(self, seq: int) -> None:
        """Fail early, naming the file, if no training window of `seq` tokens plus a target fits."""
        if len(self.train) < seq + 1:
            raise XtrainError(
                f"corpus '{self.corpus_path}' is too short for SEQ={seq}: "
                f"its train split has {len(self.train)} tokens, at least {seq + 1} are needed"
            )


class BatchSampler:
    """Draws global batches from one seeded RNG that every rank constructs identically; keeps this
    rank's share.

    Each `next()` draws `batch` start offsets, offsets = rng.integers(0, len(tokens) - seq, size=batch)
    (each uniform in [0, len(tokens) - seq - 1]); sequence i is tokens[o_i : o_i + seq] with targets
    tokens[o_i + 1 : o_i + seq + 1]. Rank r keeps the sequences with i % world == r. Every rank draws
    all the offsets, so the RNGs stay in lockstep and the ranks' shares together are exactly the
    batch that world 1 would train on. For the same reason the state is the same on every rank, and
    a state saved at one world size resumes the same stream of global batches at another.

    overfit (--overfit-batch, llm.c's -a): every `next()` is the first global batch again, drawn from a
    fresh RNG of the same seed, so the saved state never moves and a resume draws that batch too.
    """

    def __init__(self, tokens: np.ndarray | TokenFiles, batch: int, seq: int, seed: int, rank: int = 0,
                 world: int = 1, overfit: bool = False):
        if not isinstance(tokens, TokenFiles):
            tokens = np.asarray(tokens)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise TypeError(f"tokens must be a 1-D array of integer ids, not {tokens.dtype} {tokens.shape}")
        if batch < 1 or seq < 1:
            raise XtrainError(f"BATCH and SEQ must be at least 1, got BATCH={batch}, SEQ={seq}")
        if seed < 0:
            raise XtrainError(f"the seed must be a non-negative integer, got {seed}")
        if world < 1 or not 0 <= rank < world:
            raise XtrainError(f"rank {rank} is not one of the {world} ranks of this world")
        if len(tokens) < seq + 1:
            raise XtrainError(
                f"a stream of {len(tokens)} tokens is too short for SEQ={seq}: at least {seq + 1} are needed"
            )
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.rank, self.world, self.overfit = rank, world, overfit
        self.n_local = len(range(rank, batch, world))
        self._rng = self._first_rng()
        self._batches_drawn = 0

    def _first_rng(self) -> np.random.Generator:
        # [seed, 1] rather than seed: the model's init draws from PCG64(seed), and the data order
        # must not be a replay of the initial weights' random stream.
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 1])))

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (inputs, targets) of the next global batch: int32 arrays of shape (n_local, seq)."""
        rng = self._first_rng() if self.overfit else self._rng
        offsets = rng.integers(0, len(self.tokens) - self.seq, size=self.batch)
        self._batches_drawn += 1
        windows = take_windows(self.tokens, offsets[self.rank :: self.world], self.seq + 1)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def _stream(self) -> dict:
        """What fixes the stream of global batches; a state only fits a sampler with the same."""
        return {"seed": self.seed, "batch": self.batch, "seq": self.seq, "n_tokens": len(self.tokens)}

    def state(self) -> dict:
        """A JSON-serialisable snapshot; `load_state` of it makes `next()` continue exactly from here."""
        bits = self._rng.bit_generator.state
        return {
            **self._stream(),
            "batches_drawn": self._batches_drawn,
            # PCG64's state and increment are 128-bit: as strings they survive JSON readers that
            # hold numbers in doubles.
            "pcg64": {
                "state": str(bits["state"]["state"]),
                "inc": str(bits["state"]["inc"]),
                "has_uint32": bits["has_uint32"],
                "uinteger": bits["uinteger"],
            },
        }

    def load_state(self, state: dict) -> None:
        saved = {name: state.get(name) for name in self._stream()}
        if saved != self._stream():
            raise XtrainError(f"sampler state was saved for {saved}, but this sampler draws {self._stream()}")
        try:
            pcg64 = state["pcg64"]
            self._rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(pcg64["state"]), "inc": int(pcg64["inc"])},
                "has_uint32": int(pcg64["has_uint32"]),
                "uinteger": int(pcg64["uinteger"]),
            }
            self._batches_drawn = int(state["batches_drawn"])
        except (KeyError, TypeError, ValueError) as err:
            raise XtrainError(f"sampler state is malformed ({type(err).__name__}: {err})") from None
