"""Encode a UTF-8 text into an llm.c token file, for a corpus too large to encode at every start.

train_ddp encodes a text CORPUS itself (and caches the ids), which needs the whole text in memory. A
token file holds the ids already made and is read where it lies, window by window, however large:

    xtrain-tokenize TOKENIZER TEXT OUT.bin
    xtrain-train STEPS BATCH SEQ TOKENIZER OUT.bin

A text larger than memory as ids goes into shards, as llm.c's dev/data/fineweb.py writes FineWeb: the
first --val-ids ids into OUT_val_000000.bin, then --shard-ids ids a file into OUT_train_000001.bin,
OUT_train_000002.bin, ...; only one shard's ids are held at a time:

    xtrain-tokenize TOKENIZER TEXT OUT --shard-ids 100000000 --val-ids 10000000
    xtrain-train STEPS BATCH SEQ TOKENIZER "OUT_train_*.bin" --val-corpus OUT_val_000000.bin

The ids are exactly those train_ddp would make of TEXT (the text is read and encoded block by block,
cut only where the encoding cuts it anyway), so a run on OUT.bin trains on the same stream as a run on
TEXT and resumes its checkpoints. The format is llm.c's (dev/data/data_common.py): a header of 256
int32 (20240520, version 1, the number of ids) then uint16 ids, or magic 20240801, version 7 and uint32
ids for a vocabulary above 65536; llm.c reads the file too.
"""

import argparse
import glob
import sys
import time
from pathlib import Path

import numpy as np

from xtrain_dist import files
from xtrain_dist.command import OneLineParser, command_name, positive_int, run_command
from xtrain_dist.data.corpus import encode_checked, read_tokenizer, text_blocks
from xtrain_dist.data.token_files import token_file_chunks
from xtrain_dist.errors import XtrainError


def encode(tokenizer, tokenizer_path: Path, text_path: Path, block_chars: int, sizes: dict):
    """The ids of the text, block by block, in the token file's type (2 or 4 bytes an id); sets
    sizes["bytes"] to the text's size once it is read."""
    try:
        with files.reading("text", text_path), open(text_path, encoding="utf-8", newline="") as f:
            for block in text_blocks(f, block_chars):
                yield encode_checked(tokenizer, block, tokenizer_path, f"text '{text_path}'")
            sizes["bytes"] = f.buffer.tell()
    except UnicodeDecodeError as err:
        raise XtrainError(f"text '{text_path}' is not UTF-8 text ({err.reason})") from None


class Shards:
    """Ids into llm.c-style shards as they come: the first `val_ids` into PREFIX_val_000000.bin, then
    `shard_ids` a file into PREFIX_train_NNNNNN.bin (numbered on from the val shard, as fineweb.py
    does), each written whole or not at all; at most one shard's ids are held."""

    def __init__(self, prefix: Path, shard_ids: int, val_ids: int, vocab_size: int):
        self.prefix, self.shard_ids, self.val_ids, self.vocab_size = prefix, shard_ids, val_ids, vocab_size
        self.pending, self.held, self.total, self.written = [], 0, 0, []

    def _next_size(self) -> int:
        return self.val_ids if self.val_ids and not self.written else self.shard_ids

    def add(self, ids: np.ndarray) -> None:
        self.total += len(ids)
        while len(ids):
            # a full shard is written once an id after it comes: then it is not the last, and a text too
            # short for the val shard and a train shard is refused by close() with nothing written
            if self.held == self._next_size():
                self._flush()
            take = min(len(ids), self._next_size() - self.held)
            self.pending.append(ids[:take])
            self.held += take
            ids = ids[take:]

    def close(self) -> None:
        if self.val_ids and self.total <= self.val_ids:
            raise XtrainError(f"the text has {self.total} ids: --val-ids {self.val_ids} leaves none to train on")
        if self.held:
            self._flush()

    def _flush(self) -> None:
        path = shard_path(self.prefix, "val" if self.val_ids and not self.written else "train", len(self.written))
        ids = np.concatenate(self.pending)
        files.write_atomic(path, token_file_chunks(ids, self.vocab_size), "output")
        print(f"wrote {path}: {len(ids)} ids")
        self.written.append(path)
        self.pending, self.held = [], 0


def shard_path(prefix: Path, split: str, index: int) -> Path:
    return prefix.parent / f"{prefix.name}_{split}_{index:06d}.bin"


def old_shards(prefix: Path) -> list[str]:
    """Shards an earlier run left under this prefix: a pattern over them would mix the two texts."""
    pattern = glob.escape(str(prefix))
    return sorted(glob.glob(pattern + "_val_*.bin") + glob.glob(pattern + "_train_*.bin"))


def run(args) -> None:
    if args.val_ids and not args.shard_ids:
        raise XtrainError("--val-ids needs --shard-ids: the validation ids go into a shard of their own")
    files.refuse_output_on_inputs(args.out, "output", [("the tokenizer", args.tokenizer), ("the text", args.text)],
                                  "it would be replaced by the token file")
    tokenizer = read_tokenizer(args.tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    started, sizes = time.perf_counter(), {}
    blocks = encode(tokenizer, args.tokenizer, args.text, args.block_chars, sizes)
    if args.shard_ids:
        if old := old_shards(args.out):
            raise XtrainError(f"output '{old[0]}' is there from before ({len(old)} shard(s) under '{args.out}'): "
                              "remove them first, or a pattern over the shards would mix two texts")
        files.check_writable(shard_path(args.out, "train", 0), "output")
        shards = Shards(args.out, args.shard_ids, args.val_ids, vocab_size)
        for ids in blocks:
            shards.add(ids)
        if shards.total == 0:
            raise XtrainError(f"text '{args.text}' is empty")
        shards.close()
        print(summary(args.text, sizes["bytes"], shards.total, started))
    else:
        files.check_writable(args.out, "output")
        ids = np.concatenate([np.zeros(0, dtype=np.uint16), *blocks])
        if len(ids) == 0:
            raise XtrainError(f"text '{args.text}' is empty")
        header, ids = token_file_chunks(ids, vocab_size)
        print(summary(args.text, sizes["bytes"], len(ids), started))
        files.write_atomic(args.out, [header, ids], "output")
        print(f"wrote {args.out}: {len(header) + ids.nbytes} bytes, {ids.dtype.name} ids")


def summary(text: Path, n_bytes: int, n_ids: int, started: float) -> str:
    return (f"{text}: {n_bytes} bytes -> {n_ids} tokens ({n_bytes / n_ids:.2f} bytes per token) in "
            f"{time.perf_counter() - started:.1f} s")


PROG = "tokenize_corpus"


def tokenize(argv: list[str]) -> None:
    parser = OneLineParser(prog=command_name(PROG), description=__doc__)
    parser.add_argument("tokenizer", type=Path, help="tokenizers JSON file (tokenizer.json)")
    parser.add_argument("text", type=Path, help="UTF-8 text to encode")
    parser.add_argument("out", type=Path, help="the llm.c token file to write (with --shard-ids: the shards' "
                                               "name prefix)")
    parser.add_argument("--shard-ids", type=positive_int, default=None,
                        help="write shards of this many ids, OUT_train_NNNNNN.bin, holding one at a time")
    parser.add_argument("--val-ids", type=positive_int, default=None,
                        help="with --shard-ids: the first this many ids go into OUT_val_000000.bin")
    parser.add_argument("--block-chars", type=int, default=1 << 24, help=argparse.SUPPRESS)  # tests: small blocks
    run(parser.parse_args(argv))


def main(argv=None) -> int:
    return run_command(PROG, lambda: tokenize(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
