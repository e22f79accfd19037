"""Validation loss on a fixed set of held-out sequences: the same set, and the same value, whatever
the world size, seed or training state of the run; and `python -m xtrain_dist.evaluate DIR [CORPUS]`,
the same loss of a checkpoint after the run.

The set is `n_batches` global batches of `batch` windows of `seq` tokens from the validation split,
their starts spread evenly over the whole split (no RNG: every run, whatever its seed, is measured
on the same text, so curves of different runs compare). Rank r evaluates the sequences i with
i % world == r, batch by batch as training shards them; each rank sums its per-token losses in
float64 and one all-reduce adds the ranks' sums. World sizes then differ only in how float32
GEMMs round rows of different batch shapes, far below 1e-6 of the mean.
"""

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from ..backend import BACKENDS, numpy_ops
from ..command import OneLineParser, command_name, non_empty_path, positive_int, run_command
from ..data.corpus import Corpus
from ..data.token_files import TokenFiles, take_windows
from ..errors import XtrainError

PROG = "evaluate"


class Evaluator:
    def __init__(self, tokens: np.ndarray | TokenFiles, batch: int, seq: int, n_batches: int, rank: int, world: int,
                 backend, source: str = "the validation split"):
        """`source` names the tokens where there are too few of them for one window."""
        if len(tokens) < seq + 1:
            raise XtrainError(f"{source} has {len(tokens)} tokens, too few for one window of SEQ={seq} and its "
                              "targets")
        self.ops = backend
        n = batch * n_batches
        last = len(tokens) - seq - 1  # the last start whose window and targets fit
        starts = np.arange(n, dtype=np.int64) * last // max(1, n - 1)
        self.batches = []
        for b in range(n_batches):
            windows = take_windows(tokens, starts[b * batch: (b + 1) * batch][rank::world], seq + 1)
            self.batches.append((backend.from_host(np.ascontiguousarray(windows[:, :-1])),
                                 backend.from_host(np.ascontiguousarray(windows[:, 1:]))))
        self.n_tokens = n * seq

    def loss(self, model, comm) -> float:
        """Mean cross-entropy over the whole set, on every rank (a collective: every rank calls it). With
        pipeline parallelism each batch runs through the stages and the last one's sum goes to every stage."""
        xp = self.ops.xp
        total = xp.zeros(1, dtype=xp.float64)
        for ids, targets in self.batches:
            losses = model.forward(ids, targets) if model.pp is None else model.pipelined_losses(ids, targets)
            if losses is not None:
                total += losses.sum(dtype=xp.float64)
        if model.pp is not None:  # the last stage's sum, the others' zero: every stage gets the same bits
            model.pp.all_reduce(total)
        comm.all_reduce(total)
        return float(self.ops.to_host(total)[0]) / self.n_tokens


def check(cfg, corpus, log):
    """Before the run: validation ids too few for SEQ are an error where the command line asked for them
    (--val-corpus, or --eval-every without --hellaswag), and skip only the default end-of-run evaluation on
    the corpus's own split (with a line saying so). Options that ask for a validation loss with
    --eval-batches 0 are refused, not ignored."""
    if cfg.eval_every and not cfg.eval_batches and not cfg.hellaswag:
        raise XtrainError("--eval-every needs --eval-batches of at least 1 (or --hellaswag)")
    if corpus.val_path is not None and not cfg.eval_batches:
        raise XtrainError("--val-corpus needs --eval-batches of at least 1: with 0 no validation loss is measured")
    if cfg.eval_batches == 0 or len(corpus.val) >= cfg.seq + 1:
        return cfg
    reason = f"{corpus.val_source} has {len(corpus.val)} tokens, at least SEQ+1 = {cfg.seq + 1} are needed"
    if corpus.val_path is not None:
        raise XtrainError(f"--val-corpus: {reason}")
    if cfg.eval_every and not cfg.hellaswag:
        raise XtrainError(f"--eval-every: {reason}")
    log(f"no validation loss: {reason}")
    return replace(cfg, eval_batches=0)


# ------------------------------------------------------------------------------- the command line
def build_parser() -> OneLineParser:
    p = OneLineParser(prog=command_name(f"python -m xtrain_dist.{PROG}"),
                      description="Validation loss of a checkpoint: by default on the held-out set its run measured "
                                  "(the same windows, so the same loss), or on all of CORPUS.")
    p.add_argument("checkpoint", metavar="DIR", help="a checkpoint folder (or, with CORPUS, a Hugging Face GPT-2 one)")
    p.add_argument("corpus", metavar="CORPUS", nargs="?", type=non_empty_path, default=None,
                   help="a text or llm.c token files (a quoted glob) to measure instead, encoded with DIR's "
                        "tokenizer.json; all of it is held out")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="windows per batch (default: the run's BATCH, or 8)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per window (default: the run's SEQ, or 64)")
    p.add_argument("--batches", type=positive_int, default=None,
                   help="batches (default: the run's --eval-batches, or 20)")
    p.add_argument("--backend", choices=BACKENDS, default="numpy", help="where the model runs: numpy (CPU) or cuda")
    return p


def evaluate_checkpoint(argv) -> tuple[float, str]:
    """(the mean loss, the line that says it) for the command line's arguments."""
    from ..checkpoint.store import STATE, TOKENIZER
    from ..comm.local import LocalGroup
    from .sample import load_for_command

    args = build_parser().parse_args(argv)
    folder = Path(args.checkpoint)
    model, _, ckpt = load_for_command(PROG, folder, args.backend)
    # a run of ours (Checkpoint.state: checked, a corrupt one is one line) gives what held-out set it measured
    # and the defaults (its BATCH, SEQ and --eval-batches), also on another CORPUS
    has_state = STATE in ckpt.manifest.get("files", {})
    if args.corpus is None and not has_state:
        raise XtrainError(f"checkpoint '{folder}' has no {STATE} (it is not a run of ours): give CORPUS to "
                          "evaluate it on")
    run = ckpt.state if has_state else None
    config = run["config"] if run else {}
    batch, seq = args.batch or config.get("batch") or 8, args.seq or config.get("seq") or 64
    batches = args.batches or config.get("eval_batches") or 20
    tokenizer = ckpt.folder / TOKENIZER  # where it was read: after an interrupted save, not under DIR
    if args.corpus is not None:
        corpus = Corpus.load(tokenizer, args.corpus, val_path=args.corpus)
        source = f"corpus '{args.corpus}'"
    else:
        data = run["data"]
        # val_corpus: absent from checkpoints written before --val-corpus, whose runs held out a split
        corpus = Corpus.load(tokenizer, data["corpus"], val_path=data.get("val_corpus") or None)
        if corpus.train_sha256 != data["train_tokens_sha256"]:
            raise XtrainError(f"corpus '{data['corpus']}' no longer gives the ids checkpoint '{folder}' was trained "
                              "on: it changed since the run; give CORPUS to evaluate on it as it is")
        source = corpus.val_source
    if seq > model.config.n_ctx:
        raise XtrainError(f"--seq ({seq}) exceeds the model's context length ({model.config.n_ctx})")
    held_out = Evaluator(corpus.val, batch, seq, batches, 0, 1, model.ops, source=source)
    # the BLAS threads train_ddp gives a rank by default: OpenBLAS's products are not the same bits at
    # every thread count on every CPU (on an AMD EPYC, 1 and 2 threads differ), and with the same count the
    # loss is the one such a run printed, to the bit
    with threadpool_limits(numpy_ops.CPU_THREADS_PER_RANK, user_api="blas"):
        loss = held_out.loss(model, LocalGroup(1).communicator(0))
    return loss, (f"{PROG}: loss {loss:.6f} (perplexity {math.exp(min(loss, 700)):.2f}) on {batches} x {batch} "
                  f"windows of {seq} tokens of {source}")


def main(argv=None) -> int:
    return run_command(PROG, lambda: print(evaluate_checkpoint(sys.argv[1:] if argv is None else argv)[1]))


if __name__ == "__main__":
    sys.exit(main())
