"""The command line: python -m xtrain_dist.train_ddp STEPS BATCH SEQ [TOKENIZER CORPUS] [options]

Checks the input, loads the corpus once, starts one rank per thread, prints a progress line per
step and writes the report. Any problem with the input ends in one line and exit status 2; a rank
that fails ends the run with one line naming the rank and exit status 1.
"""

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from . import ddp
from .backend import BACKENDS
from .config import PRESETS, TrainConfig, model_config
from .data import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from .errors import XtrainError
from .launch import RankFailed, run_thread_ranks
from .train import train_rank

PROG = "train_ddp"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        # "argument STEPS: must be a positive integer ..." reads better as "STEPS must be ..."
        raise XtrainError(re.sub(r"^argument (\S+): must ", r"\1 must ", message))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got '{text}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m xtrain_dist.{PROG}",
                description="Data-parallel GPT-2 training: one rank per thread (per GPU with --backend cuda).")
    p.add_argument("steps", metavar="STEPS", type=_positive_int, help="optimizer steps to run")
    p.add_argument("batch", metavar="BATCH", type=_positive_int, help="sequences per step, all ranks together")
    p.add_argument("seq", metavar="SEQ", type=_positive_int, help="tokens per sequence")
    p.add_argument("tokenizer", metavar="TOKENIZER", nargs="?", help=f"tokenizer.json (default {DEFAULT_TOKENIZER})")
    p.add_argument("corpus", metavar="CORPUS", nargs="?", help=f"UTF-8 text (default {DEFAULT_CORPUS})")
    p.add_argument("--backend", choices=BACKENDS, default="numpy")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (threads)")
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="end of the cosine (default lr/10)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default lr-decay-steps/20")
    p.add_argument("--lr-decay-steps", type=int, default=None, help="length of the schedule (default STEPS)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global norm clip; 0 disables")
    p.add_argument("--comm-timeout", type=float, default=300.0, help="seconds a rank may wait in a collective")
    p.add_argument("--report", default=None, help="write a JSON report here")
    p.add_argument("--log-every", type=int, default=1)
    sync = p.add_argument_group("gradient synchronisation, ZeRO-1 and accumulation (see docs/ddp.md)")
    sync.add_argument("--grad-sync", choices=list(ddp.STRATEGIES), default="bucketed",
                      help="when and in what pieces gradients are reduced (default bucketed)")
    sync.add_argument("--bucket-mb", type=float, default=25.0, help="bucketed: MiB per bucket (default 25)")
    sync.add_argument("--grad-compress", choices=ddp.COMPRESSIONS, default="none",
                      help="bf16: round gradients to bfloat16 for the reduction")
    sync.add_argument("--zero", type=int, choices=(0, 1), default=0, help="1: shard the optimizer state (ZeRO-1)")
    sync.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    return p


def parse_config(argv) -> TrainConfig:
    args = build_parser().parse_args(argv)
    if (args.tokenizer is None) != (args.corpus is None):
        raise XtrainError("give both TOKENIZER and CORPUS, or neither (for the shipped data)")
    if args.world_size < 1:
        raise XtrainError(f"--world-size must be at least 1, got {args.world_size}")
    if args.batch < args.world_size:
        raise XtrainError(f"BATCH ({args.batch}) must be at least the world size ({args.world_size}): "
                          "every rank needs a sequence")
    if args.log_every < 1:
        raise XtrainError(f"--log-every must be at least 1, got {args.log_every}")
    return TrainConfig(
        steps=args.steps, batch=args.batch, seq=args.seq,
        tokenizer=str(args.tokenizer or DEFAULT_TOKENIZER), corpus=str(args.corpus or DEFAULT_CORPUS),
        model=args.model, backend=args.backend, world_size=args.world_size, seed=args.seed,
        lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, lr_decay_steps=args.lr_decay_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        comm_timeout_s=args.comm_timeout, report=args.report, log_every=args.log_every,
        grad_sync=args.grad_sync, bucket_mb=args.bucket_mb, grad_compress=args.grad_compress, zero=args.zero,
        grad_accum=args.grad_accum,
    ).resolved()


def check_config(cfg: TrainConfig, corpus: Corpus) -> None:
    """What needs the corpus to check: the model fits the sequence, the text fits the batch."""
    model = model_config(cfg.model, corpus.vocab_size)
    if cfg.seq > model.n_ctx:
        raise XtrainError(f"SEQ ({cfg.seq}) exceeds the context length of model '{cfg.model}' ({model.n_ctx})")
    corpus.check_seq(cfg.seq)
    ddp.check_config(cfg)


def train(cfg: TrainConfig, corpus: Corpus | None = None, log=print) -> dict:
    """Run a whole training job in this process and return its report (a JSON-ready dict)."""
    corpus = corpus or Corpus.load(cfg.tokenizer, cfg.corpus)
    check_config(cfg, corpus)
    # the backend is checked before any thread starts, so a missing CUDA is one clean line
    if cfg.backend == "cuda":
        from .backend import get_backend
        get_backend("cuda", 0)
    log(f"{cfg.model}: {model_config(cfg.model, corpus.vocab_size)} | {cfg.backend} backend, "
        f"{cfg.world_size} rank(s), batch {cfg.batch} x {cfg.seq} tokens")
    t0 = time.perf_counter()
    results = run_thread_ranks(
        cfg.world_size, lambda rank, comm: train_rank(rank, comm, cfg, corpus, device=None, log=log),
        timeout_s=cfg.comm_timeout_s)
    wall = time.perf_counter() - t0
    lead = results[0]
    timed = lead.step_ms[1:] or lead.step_ms  # the first step pays for warm-up
    ms = float(np.mean(timed))
    return {
        "config": cfg.to_dict(),
        "model": {"preset": cfg.model, **vars(model_config(cfg.model, corpus.vocab_size)),
                  "num_params": lead.num_params},
        "losses": lead.losses,
        "grad_norms": lead.grad_norms,
        "lrs": lead.lrs,
        "step_ms": lead.step_ms,
        "ms_per_step": ms,
        "tokens_per_s": cfg.batch * cfg.seq / ms * 1e3,
        "wall_s": wall,
        "param_sha256": [r.param_sha256 for r in results],
        "optimizer_state_bytes": [r.optimizer_state_bytes for r in results],
        **ddp.report_fields(cfg, results),
    }


def write_json_atomic(path: str, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    try:
        cfg = parse_config(sys.argv[1:] if argv is None else argv)
        report = train(cfg)
        if cfg.report:
            write_json_atomic(cfg.report, report)
        print(f"done: loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}, "
              f"{report['ms_per_step']:.1f} ms/step, {report['tokens_per_s']:.0f} tokens/s"
              + (f", report {cfg.report}" if cfg.report else ""))
        return 0
    except XtrainError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except RankFailed as e:
        detail = str(e.error) if isinstance(e.error, XtrainError) else f"{type(e.error).__name__}: {e.error}"
        print(f"{PROG}: error: rank {e.rank} failed: {detail}", file=sys.stderr)
        if os.environ.get("XTRAIN_TRACEBACK"):
            import traceback
            traceback.print_exception(e.error)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

