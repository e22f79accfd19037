"""Text to token ids: a tokenizer read and checked, a text encoded (and its ids cached on disk), and the corpus
a run trains on.

`Corpus` encodes a UTF-8 text file with any `tokenizers` JSON file, caches the ids on disk and keeps
the last part of the stream for validation; or it reads ids already made, from llm.c's token files
(token_files.TokenFiles), without loading them into memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers

from xtrain_dist import files, shipped
from xtrain_dist.errors import XtrainError, first_line

from .token_files import TokenFiles, open_token_files

DEFAULT_TOKENIZER = shipped.DATA_DIR / "tokenizer.json"
DEFAULT_CORPUS = shipped.DATA_DIR / "shakespeare.txt"

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
            ids = open_token_files(what, path)
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
