"""HellaSwag (and any multiple-choice eval in llm.c's eval-file format): the accuracy llm.c reports.

python -m xtrain_dist.hellaswag DIR EVALFILE [--backend numpy|cuda] [--tokens N]

An example is a context and its candidate completions, one of them right (the label). Each completion
is scored by the model's mean cross-entropy over the completion's tokens, predicted from the context
and the completion's earlier tokens; the prediction is the completion with the lowest mean loss (the
first of equals), and the accuracy is the share of examples whose prediction is the label. That is
llm.c's `evalloader_stat_losses` and the "acc_norm" of its dev/data/hellaswag.py (the mean, not the
sum, so that longer completions are not penalised for their length).

The eval file (llm.c's dev/data/data_common.py `write_evalfile`): a header of 256 little-endian int32
(magic 20240522, version 1, number of examples, longest example in bytes), then per example a stream
of uint16: 65535 (start), the example's size in bytes, its index, its label, the number of
completions, then the context and each completion as a length followed by that many token ids.
llm.c's `hellaswag_val.bin` is written with GPT-2's tokenizer; `xtrain-prepare-hellaswag` writes one
with the tokenizer a run trains with. A model is scored on ids of its own tokenizer only: a file made
with another one reads as valid ids and gives chance accuracy.

In training (`train_ddp --hellaswag FILE`), example i is scored by rank i % world, a few examples
per forward pass, and one all-reduce adds up the ranks' counts: the same accuracy for any world size.
"""

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backend import BACKENDS
from ..command import OneLineParser, command_name, non_empty_path, positive_int, run_command
from ..config import model_config
from ..data.token_files import TOKEN_FILE_HEADER_BYTES
from ..errors import XtrainError
from ..files import reading
from .sample import load_for_command

EVAL_FILE_MAGIC = 20240522
EVAL_FILE_VERSION = 1
HEADER_BYTES = TOKEN_FILE_HEADER_BYTES  # the header of llm.c's token files: 256 int32, magic and version first
START_EXAMPLE = 2**16 - 1  # never a token id: the file's ids are uint16 below it
PROG = "hellaswag"


@dataclass(frozen=True)
class Example:
    index: int
    label: int                      # the right completion
    context: np.ndarray             # int32 ids
    completions: tuple[np.ndarray, ...]

    @property
    def longest_row(self) -> int:
        """Positions a forward pass needs to score every completion: the last id is only a target."""
        return len(self.context) + max(len(c) for c in self.completions) - 1


def row_width(examples: list[Example]) -> int:
    """Positions a forward pass needs to score every completion of `examples`."""
    return max(ex.longest_row for ex in examples)


def eval_file_chunks(examples: list[Example]) -> list[bytes]:
    """The bytes of an eval file holding `examples`, as [header, stream] for files.write_atomic."""
    stream, longest = [], 0
    for i, ex in enumerate(examples):
        parts = [[len(ex.context)], ex.context]
        for c in ex.completions:
            parts += [[len(c)], c]
        body = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        nbytes = 2 * (5 + len(body))
        if nbytes >= 2**16 or len(examples) >= 2**16:
            raise XtrainError(f"example {i} does not fit llm.c's eval file (at most 65535 examples of "
                              f"under 64 KiB each)")
        if body.size and (body.min() < 0 or body.max() >= START_EXAMPLE):
            raise XtrainError(f"example {i} has an id outside 0..{START_EXAMPLE - 1}, which an eval file "
                              "cannot hold")
        stream.append(np.concatenate([[START_EXAMPLE, nbytes, i, ex.label, len(ex.completions)], body]))
        longest = max(longest, nbytes)
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:4] = EVAL_FILE_MAGIC, EVAL_FILE_VERSION, len(examples), longest
    body = np.concatenate(stream).astype("<u2") if stream else np.zeros(0, "<u2")
    return [header.tobytes(), body.tobytes()]


def read_eval_file(path, vocab_size: int, what: str = "--hellaswag") -> list[Example]:
    """The examples of the eval file at `path`, every field checked: one XtrainError naming the file and
    the first thing wrong with it."""
    path = Path(path)
    with reading(what, path):
        raw = path.read_bytes()
    where = f"{what} '{path}'"
    if len(raw) < HEADER_BYTES:
        raise XtrainError(f"{where} is not an llm.c eval file (shorter than its {HEADER_BYTES}-byte header)")
    magic, version, count, _longest = (int(v) for v in np.frombuffer(raw, "<i4", count=4))
    if magic != EVAL_FILE_MAGIC:
        raise XtrainError(f"{where} is not an llm.c eval file (magic {magic}, not {EVAL_FILE_MAGIC})")
    if version != EVAL_FILE_VERSION:
        raise XtrainError(f"{where} is an llm.c eval file of version {version}; this trainer reads version "
                          f"{EVAL_FILE_VERSION}")
    if (len(raw) - HEADER_BYTES) % 2:
        raise XtrainError(f"{where} is cut short: its examples are not a whole number of uint16")
    words = np.frombuffer(raw, "<u2", offset=HEADER_BYTES).astype(np.int64)
    examples, at = [], 0
    while at < len(words):
        i = len(examples)
        bad = f"{where}, example {i}"
        if words[at] != START_EXAMPLE:
            raise XtrainError(f"{bad} does not start with the marker {START_EXAMPLE} (a damaged file?)")
        if at + 5 > len(words):
            raise XtrainError(f"{bad} is cut short")
        nbytes, index, label, n_completions = (int(v) for v in words[at + 1: at + 5])
        end = at + nbytes // 2
        if nbytes % 2 or end > len(words) or nbytes < 10:
            raise XtrainError(f"{bad} is cut short or misstates its size ({nbytes} bytes)")
        if index != i:
            raise XtrainError(f"{bad} carries the index {index} (examples are numbered in file order)")
        fields, pos = [], at + 5
        for _ in range(1 + n_completions):  # the context, then each completion
            if pos >= end or pos + 1 + words[pos] > end:
                raise XtrainError(f"{bad}: its context and completions run past its {nbytes} bytes")
            n = int(words[pos])
            if n == 0:
                raise XtrainError(f"{bad} has an empty context or completion")
            fields.append(words[pos + 1: pos + 1 + n].astype(np.int32))
            pos += 1 + n
        if pos != end:
            raise XtrainError(f"{bad}: its context and completions end before its {nbytes} bytes do")
        if n_completions < 2 or not 0 <= label < n_completions:
            raise XtrainError(f"{bad} has label {label} among {n_completions} completions")
        if examples and n_completions != len(examples[0].completions):
            raise XtrainError(f"{bad} has {n_completions} completions, example 0 has "
                              f"{len(examples[0].completions)}: every example of a file needs the same number")
        top = max(int(f.max()) for f in fields)
        if top >= vocab_size:
            raise XtrainError(f"{bad} holds the id {top}, outside the tokenizer's vocabulary of {vocab_size} "
                              "(a file made with another tokenizer)")
        examples.append(Example(index, label, fields[0], tuple(fields[1:])))
        at = end
    if not examples:
        raise XtrainError(f"{where} holds no examples")
    if len(examples) != count:
        raise XtrainError(f"{where} holds {len(examples)} examples, its header says {count}")
    return examples


def check(examples: list[Example], n_ctx: int, path: str, what: str = "--hellaswag") -> None:
    """Every completion must fit the model's positions with its context."""
    longest = max(examples, key=lambda ex: ex.longest_row)
    if longest.longest_row > n_ctx:
        raise XtrainError(f"{what} '{path}', example {longest.index}: its context and longest completion "
                          f"need {longest.longest_row} positions, the model has {n_ctx}")


def load(cfg, corpus) -> list[Example]:
    """--hellaswag's examples, checked against the run's tokenizer and model."""
    examples = read_eval_file(cfg.hellaswag, corpus.vocab_size)
    check(examples, model_config(cfg.model, corpus.vocab_size).n_ctx, cfg.hellaswag)
    return examples


def sha256(examples: list[Example]) -> str:
    """Of the examples as a file: processes that read different files cannot score one accuracy."""
    return hashlib.sha256(b"".join(eval_file_chunks(examples))).hexdigest()


def render(examples: list[Example], width: int):
    """The forward pass's input for `examples`, one row per completion, example by example:
    ids and targets (R, width) int32, and mask (R, width) float32, 1 where the target is a completion
    token. A row is context + completion without its last id, and its targets the same shifted by one;
    the rest of the row is id 0 (any id would do: the mask drops it, and causal attention keeps it from
    changing the positions before it)."""
    rows = [np.concatenate([ex.context, c]) for ex in examples for c in ex.completions]
    ids = np.zeros((len(rows), width), dtype=np.int32)
    targets = np.zeros((len(rows), width), dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    starts = [len(ex.context) - 1 for ex in examples for _ in ex.completions]
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        n = len(row) - 1
        ids[r, :n], targets[r, :n], mask[r, start:n] = row[:-1], row[1:], 1.0
    return ids, targets, mask


def passes_by_length(examples: list[Example], tokens: int) -> list[list[int]]:
    """Indices into `examples`, grouped into forward passes of about `tokens` positions each (at least one
    example a pass). Shortest first, so that a pass's rows are of about one length: each pass is as wide as
    its longest row, and HellaSwag's rows range from a few dozen positions to a few hundred, so passes in
    file order would spend most of their positions on padding."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].longest_row)
    passes, current = [], []
    for i in order:
        rows = (len(current) + 1) * len(examples[i].completions)
        if current and rows * examples[i].longest_row > tokens:  # sorted: the newcomer is the widest
            passes.append(current)
            current = []
        current.append(i)
    return passes + ([current] if current else [])


class HellaSwag:
    """A rank's share of an eval file (examples i with i % world == rank), rendered once on its backend in
    forward passes of about `tokens` positions (passes_by_length)."""

    def __init__(self, examples: list[Example], tokens: int, rank: int, world: int, backend):
        self.ops = backend
        self.n_examples = len(examples)
        self.n_completions = len(examples[0].completions)
        mine = examples[rank::world]
        chunks = passes_by_length(mine, tokens)
        # the most passes any rank runs: where every rank must run each forward together (ZeRO-3's gathers,
        # model.WholeBuffers.forward_is_collective) a rank with fewer runs empty ones to that count
        self.most_passes = max(len(passes_by_length(examples[r::world], tokens)) for r in range(world))
        self.empty = backend.from_host(np.zeros((1, 1), dtype=np.int32))
        self.passes = []
        for chunk in chunks:
            chosen = [mine[i] for i in chunk]
            ids, targets, mask = render(chosen, row_width(chosen))
            self.passes.append((backend.from_host(ids), backend.from_host(targets), backend.from_host(mask)))
        # the share's examples in the order the passes score them, to put the scores back in share order
        self.ran = backend.from_host(np.array([i for chunk in chunks for i in chunk], dtype=np.int64))
        self.labels = backend.from_host(np.array([ex.label for ex in mine], dtype=np.int64))

    def completion_losses(self, model):
        """(examples of this rank, completions), in the order of its share: each completion's mean loss over
        its tokens, in float64, on the backend. With pipeline parallelism each pass runs through the stages
        and only the last one scores: None on the others."""
        xp = self.ops.xp
        scores = []
        for ids, targets, mask in self.passes:
            losses = model.forward(ids, targets) if model.pp is None else model.pipelined_losses(ids, targets)
            if losses is None:  # a pipeline stage before the last
                continue
            losses = losses.astype(xp.float64)
            scores.append((losses * mask).sum(axis=1) / mask.sum(axis=1))
        if model.units.forward_is_collective:
            for _ in range(self.most_passes - len(self.passes)):
                model.forward(self.empty, self.empty)
        if self.passes and not scores:
            return None
        if not scores:  # a rank with no example (more ranks than examples)
            return xp.zeros((0, self.n_completions), dtype=xp.float64)
        in_share_order = xp.empty((len(self.ran), self.n_completions), dtype=xp.float64)
        in_share_order[self.ran] = xp.concatenate(scores).reshape(-1, self.n_completions)
        return in_share_order

    def correct(self, model, comm=None) -> int:
        """Examples whose lowest-loss completion is the label, over all ranks (a collective where comm is
        given: every rank calls it)."""
        xp = self.ops.xp
        losses = self.completion_losses(model)
        if losses is None:  # a pipeline stage before the last: the last one counts
            count = xp.zeros(1, dtype=xp.float64)
        else:
            count = (losses.argmin(axis=1) == self.labels).sum().astype(xp.float64).reshape(1)
        if model.pp is not None:
            model.pp.all_reduce(count)
        if comm is not None:
            comm.all_reduce(count)
        return int(self.ops.to_host(count)[0])

    def accuracy(self, model, comm=None) -> float:
        return self.correct(model, comm) / self.n_examples


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=command_name(f"python -m xtrain_dist.{PROG}"),
                      description="Multiple-choice accuracy (HellaSwag) of a checkpoint on an llm.c eval file.")
    p.add_argument("checkpoint", metavar="DIR", help="a checkpoint folder, or a Hugging Face GPT-2 folder")
    p.add_argument("eval_file", metavar="EVALFILE", type=non_empty_path,
                   help="an llm.c eval file made with the checkpoint's tokenizer (xtrain-prepare-hellaswag)")
    p.add_argument("--backend", choices=BACKENDS, default="numpy", help="where the model runs: numpy (CPU) or cuda")
    p.add_argument("--tokens", type=positive_int, default=16384,
                   help="positions per forward pass (default 16384): memory against speed")
    return p


def evaluate(argv) -> str:
    args = build_parser().parse_args(argv)
    model, tokenizer, _ = load_for_command(PROG, args.checkpoint, args.backend)
    examples = read_eval_file(args.eval_file, tokenizer.get_vocab_size(with_added_tokens=True), what="EVALFILE")
    check(examples, model.config.n_ctx, args.eval_file, what="EVALFILE")
    evaluator = HellaSwag(examples, args.tokens, 0, 1, model.ops)
    right = evaluator.correct(model)
    return f"{PROG}: {right}/{len(examples)} = {right / len(examples):.4f}"


def main(argv=None) -> int:
    return run_command(PROG, lambda: print(evaluate(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())

