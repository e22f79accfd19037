"""The command line: python -m xtrain_dist.train_ddp STEPS BATCH SEQ [TOKENIZER CORPUS] [options]

Parses the arguments into a TrainConfig, runs the job (job.train) and prints its last line. Any problem
with the input ends in one line and exit status 2; a rank that fails ends the run with one line naming
the rank and exit status 1; SIGTERM or SIGUSR1 ends it after the step its ranks are in, saved, with exit
status 143 (job.StopRequest).
"""

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from .. import config_file, files, precision
from ..backend import BACKENDS
from ..checkpoint.store import RUN_CONFIG
from ..comm import CommAborted
from ..comm.launch_env import Launch, detect_launch, local_world_for
from ..comm.rendezvous import report_failure_before_world
from ..comm.ring import ALL_REDUCES
from ..command import (
    OneLineParser,
    command_name,
    non_empty_path,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    run_command,
    say_line,
    timeout_seconds,
    utf8_text,
)
from ..config import PRESETS, TrainConfig
from ..data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER
from ..errors import MachineWide, XtrainError, shown
from ..model import ATTENTIONS, RECOMPUTE_LEVELS
from ..optim import LR_SCHEDULES
from ..parallel import ddp
from ..parallel.pipeline import SCHEDULES
from ..parallel.tensor import TP_CLASSIFIERS
from ..precision import MATMULS
from ..profile import rows_markdown
from . import memory
from .graph import MODES as GRAPH_MODES
from .job import PROG, STOPPED, train
from .launch import RankFailed
from .preflight import AUTO_RESUME, NO_RESUME, RunComplete, config_beside

EXAMPLES = """examples:
  xtrain-train 300 16 64 --world-size 2 --report runs/tiny.json
      300 steps of the tiny model on the shipped Shakespeare, two rank threads on the CPU
  xtrain-train 2000 16 256 --model mini --eval-every 200 --save-dir runs/mini --resume auto
      a run that saves its checkpoint and, started again after a stop, goes on from it
  xtrain-train --config runs/mini/run_config.toml --lr 2e-3 --save-dir runs/mini-lr
      the run a configuration file describes (every run writes its own), with one change
  xtrain-train 5000 64 1024 gpt2/tokenizer.json "fineweb_train_*.bin" --backend cuda --model gpt2-124m \\
      --dtype bf16 --world-size 8 --val-corpus fineweb_val_000000.bin
      GPT-2 124M on eight GPUs from llm.c's token files
  torchrun --nproc_per_node 2 -m xtrain_dist.train_ddp 300 16 64
  mpirun -n 2 xtrain-train 300 16 64
      two processes, over TCP and over MPI"""


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=command_name(f"python -m xtrain_dist.{PROG}"),
                      description="Data-parallel GPT-2 training: one rank per thread (per GPU with --backend cuda).",
                      epilog=EXAMPLES)
    p.add_argument("steps", metavar="STEPS", type=positive_int, help="optimizer steps to run")
    p.add_argument("batch", metavar="BATCH", type=positive_int, help="sequences per step, all ranks together")
    p.add_argument("seq", metavar="SEQ", type=positive_int, help="tokens per sequence")
    # non_empty_path: an empty one would read as "not given" and quietly train on the shipped data
    p.add_argument("tokenizer", metavar="TOKENIZER", nargs="?", type=non_empty_path,
                   help=f"tokenizer.json (default {DEFAULT_TOKENIZER})")
    p.add_argument("corpus", metavar="CORPUS", nargs="?", type=non_empty_path,
                   help=f"UTF-8 text, or llm.c token files: one, or a quoted glob pattern (default {DEFAULT_CORPUS})")
    p.add_argument("--config", metavar="FILE.toml", type=non_empty_path, default=None,
                   help="take any option, and steps, batch, seq, tokenizer and corpus, from a TOML file (keys: the "
                        "options without their dashes); the command line overrides it. Every run writes its own "
                        f"beside --report and into each checkpoint ({RUN_CONFIG}): --config of it replays the run")
    p.add_argument("--backend", choices=BACKENDS, default="numpy",
                   help="numpy: every op by hand on the CPU, the reference; cuda: the kernels of kernels/ on GPUs, one "
                        "per rank")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks in the job, all processes together (default: one per process, 1 without a launcher)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks per model: each block's matrices split Megatron's way over them; "
                        "the world is dp x tp, the batch split over the dp groups (default 1; see "
                        "docs/parallelism.md)")
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline stages per model: the blocks cut into PP contiguous stages, the micro-batches of "
                        "--grad-accum run through them; the world is pp x dp x tp (default 1; see "
                        "docs/parallelism.md)")
    p.add_argument("--tp-classifier", choices=TP_CLASSIFIERS, default="vocab",
                   help="with --tp: vocab (Megatron's vocabulary-parallel embedding and cross-entropy: each rank "
                        "holds 1/tp of wte's rows and computes only its logits) or replicated (the whole wte and "
                        "logits on every rank) (default vocab; see docs/parallelism.md)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: Megatron's sequence parallelism: the residual stream, the layernorms and dropout "
                        "held as each rank's 1/tp of the tokens, all-reduces replaced by reduce-scatters and "
                        "all-gathers, so a rank keeps 1/tp of every activation (SEQ divisible by --tp; see "
                        "docs/parallelism.md)")
    p.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b",
                   help="the pipeline's order of micro-batches: gpipe (all forwards, then all backwards) or 1f1b "
                        "(one forward, one backward: fewer activations held) (default 1f1b)")
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--seed", type=non_negative_int, default=1337,
                   help="the initial weights and the order of the batches (the same on every rank)")
    p.add_argument("--overfit-batch", action="store_true",
                   help="train every step on the first global batch (llm.c's -a 1): the loss should fall toward "
                        "0, a check that forward, backward, the all-reduce and AdamW fit together")
    p.add_argument("--lr", type=non_negative_float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=non_negative_float, default=None, help="end of the decay (default lr/10)")
    p.add_argument("--warmup-steps", type=non_negative_int, default=None, help="default lr-decay-steps/20")
    p.add_argument("--lr-decay-steps", type=positive_int, default=None, help="length of the schedule (default STEPS)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine",
                   help="after warmup: cosine or linear decay to min-lr, constant, or wsd (warmup-stable-decay: lr "
                        "until the cooldown, then 1-sqrt down to min-lr) (default cosine)")
    p.add_argument("--cooldown-steps", type=positive_int, default=None,
                   help="wsd: steps of the final decay, ending at lr-decay-steps (default lr-decay-steps/5)")
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                   help="AdamW's decoupled weight decay, on the matrices and embeddings (not biases or layernorms)")
    p.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="global norm clip; 0 disables")
    p.add_argument("--comm-timeout", type=timeout_seconds, default=300.0,
                   help="seconds a rank may wait in a collective")
    p.add_argument("--tf32", action="store_true", help="cuda: TF32 tensor-core matmuls")
    p.add_argument("--matmul", choices=("auto", *MATMULS), default="auto",
                   help="cuda: cublaslt puts a linear layer's bias (and the MLP's GELU, its derivative and "
                        "every bias gradient) in the products' epilogues instead of kernels around them; "
                        "auto (default): cublaslt on cuda, the fastest measured (docs/cuda_backend.md)")
    p.add_argument("--cuda-graph", choices=GRAPH_MODES, default="auto",
                   help="cuda: auto captures the training step once as a CUDA graph and replays it, where the "
                        "communicator allows (otherwise the run says why in one line and runs without); off "
                        "queues every op every step (default auto)")
    p.add_argument("--cpu-threads", type=positive_int, default=None,
                   help="threads per rank for BLAS and the numpy ops' row and element blocks (default 1: never "
                        "slower beside other work, and the same bits whatever the cores)")
    p.add_argument("--report", type=non_empty_path, default=None, help="write a JSON report here")
    p.add_argument("--log-every", metavar="N", type=positive_int, default=1,
                   help="print the progress line every N steps (and at the last)")
    p.add_argument("--profile-step", metavar="N", type=positive_int, default=None,
                   help="time every op of step N (CUDA events on a GPU) and print where the step's time went")
    procs = p.add_argument_group("processes and launchers (torchrun, srun, mpirun)")
    procs.add_argument("--comm", default="auto", help="auto | local | mpi | tcp | nccl (default: local in one process; "
                       "across processes nccl with --backend cuda, else mpi under mpirun, tcp under torchrun/srun)")
    procs.add_argument("--rdzv-bind", metavar="HOST[:PORT]", default=None,
                       help="address rank 0's rendezvous listens on (default: the advertised address)")
    procs.add_argument("--rdzv-advertise", metavar="HOST:PORT", default=None,
                       help="address the other processes connect to (default MASTER_ADDR:MASTER_PORT; "
                            "MASTER_PORT+1 under torchrun, whose agent holds MASTER_PORT)")
    procs.add_argument("--rdzv-timeout", type=timeout_seconds, default=None,
                       help=f"seconds processes wait for each other (default {TrainConfig.rdzv_timeout_s:g})")
    g = p.add_argument_group("checkpoints, evaluation and metrics")
    g.add_argument("--save-dir", metavar="DIR", type=non_empty_path, default=None,
                   help="keep the latest checkpoint in DIR, replaced atomically at each save (and at the end)")
    g.add_argument("--save-every", metavar="N", type=non_negative_int, default=0, help="also save every N steps")
    g.add_argument("--keep-every", metavar="N", type=non_negative_int, default=0,
                   help="also keep every N-th step's checkpoint in a folder of its own, DIR.step000300 beside DIR, "
                        "which later saves do not replace (to branch from, evaluate or sample later)")
    g.add_argument("--init-from", metavar="DIR", type=non_empty_path, default=None,
                   help="start from the weights of a GPT-2 folder (a Hugging Face one such as the Hub's gpt2, or one "
                        "of our checkpoints) with a fresh optimizer and data order: fine-tuning")
    g.add_argument("--resume", metavar="DIR", type=non_empty_path, default=None,
                   help=f"continue the run whose checkpoint is DIR; '{AUTO_RESUME}': the checkpoint in --save-dir "
                        "where there is one, else start at step 1; nothing (exit 0) once it holds STEPS steps (one "
                        "command for a job's start and its requeues); 'none': start at step 1 (over a --config "
                        "file's resume)")
    g.add_argument("--eval-every", metavar="N", type=non_negative_int, default=0,
                   help="validation loss every N steps and at the end (default 0: at the end only)")
    g.add_argument("--eval-batches", metavar="N", type=non_negative_int, default=20,
                   help="held-out batches of BATCH x SEQ per evaluation; 0: none (default 20)")
    g.add_argument("--val-corpus", metavar="PATH", type=non_empty_path, default=None,
                   help="validate on this text or these token files, and train on all of CORPUS (default: hold "
                        "out CORPUS's last 10%%)")
    g.add_argument("--hellaswag", metavar="PATH", type=non_empty_path, default=None,
                   help="also score an llm.c eval file (HellaSwag, made with TOKENIZER) at each evaluation: the "
                        "share of examples whose lowest-loss completion is the right one")
    g.add_argument("--metrics", metavar="PATH", type=non_empty_path, default=None,
                   help="append one JSON line per step to PATH")
    g.add_argument("--tensorboard", metavar="DIR", type=non_empty_path, default=None,
                   help="write the same records as TensorBoard event files into DIR (needs the [tensorboard] extra: "
                        "tensorboardX)")
    g.add_argument("--wandb", metavar="PROJECT", default=None,
                   help="log the same scalars to this Weights & Biases project (needs the [wandb] extra; "
                        "WANDB_MODE=offline keeps the run on disk, no network needed)")
    g.add_argument("--sample-every", metavar="N", type=non_negative_int, default=0,
                   help="print text drawn from the model every N steps and at the end, as `python -m "
                        "xtrain_dist.sample` would from a checkpoint of that step with --seed SEED (default 0: never)")
    g.add_argument("--sample-tokens", metavar="N", type=positive_int, default=None, help="tokens per draw (default 64)")
    g.add_argument("--sample-prompt", metavar="TEXT", type=utf8_text, default="",
                   help="text the draws continue (default: start from <|endoftext|>)")
    sync = p.add_argument_group("gradient synchronisation, ZeRO-1 and accumulation (see docs/ddp.md)")
    sync.add_argument("--grad-sync", choices=list(ddp.STRATEGIES), default="bucketed",
                      help="when and in what pieces gradients are reduced (default bucketed)")
    sync.add_argument("--bucket-mb", type=positive_float, default=25.0, help="bucketed: MiB per bucket (default 25)")
    sync.add_argument("--comm-priority", choices=ddp.PRIORITIES, default="auto",
                      help="the scheduling priority of each rank's communication thread (--grad-sync bucketed, "
                           "--zero 2 and 3): realtime (SCHED_FIFO 1: Linux grants it to root, to CAP_SYS_NICE or "
                           "up to `ulimit -r`), normal, or auto: realtime where granted (default; the report's "
                           "comm_priority says which)")
    sync.add_argument("--grad-compress", choices=ddp.COMPRESSIONS, default="none",
                      help="bf16: round gradients to bfloat16 for the reduction; powersgd: send each gradient "
                           "matrix as a rank-R product with error feedback (see docs/ddp.md)")
    sync.add_argument("--powersgd-rank", metavar="R", type=int, default=TrainConfig.powersgd_rank,
                      help=f"powersgd: the rank of each matrix's approximation (default {TrainConfig.powersgd_rank})")
    sync.add_argument("--powersgd-start-step", metavar="S", type=int, default=TrainConfig.powersgd_start_step,
                      help="powersgd: the first S steps all-reduce gradients uncompressed (default "
                           f"{TrainConfig.powersgd_start_step})")
    sync.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                      help="1: shard the optimizer state (ZeRO-1); 2: the gradients too; 3: the parameters too")
    sync.add_argument("--zero3-prefetch", type=int, default=1, metavar="N",
                      help="--zero 3: gather the parameters of the next N blocks while one computes (0: when needed)")
    sync.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    sync.add_argument("--all-reduce", choices=ALL_REDUCES, default="library",
                      help="how gradients are all-reduced: library, the communicator's own (default), or ring, "
                           "the textbook ring over send/recv (comm/ring.py)")
    prec = p.add_argument_group("precision and memory (see docs/precision.md)")
    prec.add_argument("--attention", choices=("auto", *ATTENTIONS), default="auto",
                      help="flash: keep one log-sum-exp per row instead of the T x T probabilities and recompute "
                           "them in backward (cuda: a fused kernel, --dtype bf16, 64-channel heads); cudnn: the "
                           "same with cuDNN's fused kernels (cuda, bf16, 64- or 128-channel heads); standard: "
                           "Hugging Face's exact steps; auto (default): standard on numpy, on cuda the fastest "
                           "the run can take: cudnn, else flash, else standard (docs/cuda_backend.md)")
    prec.add_argument("--recompute", type=int, choices=RECOMPUTE_LEVELS, default=0,
                      help="what backward computes again instead of forward keeping it: 1 each block's GELU "
                           "output, 2 also its layernorm outputs (same bits, less memory; default 0: nothing)")
    p.add_argument("--dropout", metavar="P", type=probability, default=0.0,
                   help="drop each element with probability P where Hugging Face's GPT-2 does (embeddings, "
                        "attention probabilities, residual branches) in training, never in evaluation or sampling; "
                        "the masks are the same bits at every world size, --tp, --pp and backend (default 0: off; "
                        "needs --attention standard)")
    prec.add_argument("--dtype", choices=precision.DTYPES, default="fp32",
                      help="bf16: bfloat16 activations and matmuls, float32 master weights, gradients and "
                           "optimizer state (default fp32)")
    return p


# ---------------------------------------------------------------------------------------------- --config
def config_key(action: argparse.Action) -> str:
    """An argument's key in a --config file: its flag without the dashes (grad-sync), or the positional's
    name in lower case (steps)."""
    flags = [flag for flag in action.option_strings if flag.startswith("--")]
    return flags[0].removeprefix("--") if flags else action.dest


def config_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """key -> the argument it sets, for every argument a --config file may set (all but --help and --config)."""
    return {config_key(a): a for a in parser._actions if a.dest not in ("help", "config")}


# the argument types whose values a TOML file gives as integers, or as numbers; every other takes a string
_INTEGER_TYPES = (positive_int, non_negative_int, int)
_NUMBER_TYPES = (non_negative_float, positive_float, probability, timeout_seconds)


def _config_value(action: argparse.Action, key: str, value, where: str):
    """The value a --config file gives `action`, checked as the command line checks its text."""
    if isinstance(action, argparse._StoreTrueAction):
        kind, fits = "true or false", isinstance(value, bool)
    elif action.type in _INTEGER_TYPES:
        kind, fits = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif action.type in _NUMBER_TYPES:
        kind, fits = "a number", isinstance(value, int | float) and not isinstance(value, bool)
    else:
        kind, fits = "a string", isinstance(value, str)
    if not fits:
        try:
            given = shown(config_file.dumps({key: value}).partition(" = ")[2].strip())
        except TypeError:  # a table
            given = f"a {type(value).__name__}"
        raise XtrainError(f"{where}: {key} must be {kind}, got {given}")
    if isinstance(action, argparse._StoreTrueAction):
        return value
    try:
        parsed = action.type(str(value)) if action.type else value  # str(float) is repr: the exact double
    except argparse.ArgumentTypeError as err:
        raise XtrainError(f"{where}: {key} {err}") from None
    if action.choices is not None and parsed not in action.choices:
        raise XtrainError(f"{where}: {key} must be one of {', '.join(map(str, action.choices))}, got "
                          f"{shown(repr(value))}")
    return parsed


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the values of the --config file at `path` the parser's defaults, so that the command line
    overrides them; a positional the file gives (steps, batch, ...) need not be on the command line.
    Returns dest -> (the built-in default, the file's value) for each key of the file."""
    where = f"--config '{path}'"
    actions = config_actions(parser)
    values = {}
    for key, value in config_file.read(path, "--config").items():
        action = actions.get(key)
        if action is None:
            spelled = key.replace("_", "-")
            hint = f" (the option is spelled '{spelled}')" if spelled in actions and spelled != key else ""
            raise XtrainError(f"{where}: unknown key '{key}'{hint}: keys are the options without their dashes, "
                              "and steps, batch, seq, tokenizer, corpus")
        values[action.dest] = action.default, _config_value(action, key, value, where)
        action.default = values[action.dest][1]
    for action in parser._actions:
        if not action.option_strings:  # the file may give them: the command line fills them in order, over it
            action.nargs = "?"
    return values


def _config_path(argv: list[str]) -> str | None:
    """--config's value, read before the command line is parsed: its values become the parser's defaults."""
    p = OneLineParser(add_help=False)
    p.add_argument("--config", type=non_empty_path, default=None)
    return p.parse_known_args(argv)[0].config


def parse_config(argv, launch: Launch | None = None) -> TrainConfig:
    parser = build_parser()
    config = _config_path(argv)
    file_values = apply_config_file(parser, config) if config is not None else {}
    args = parser.parse_intermixed_args(argv)  # TOKENIZER CORPUS may come after options too
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) is None:
            raise XtrainError(f"{name.upper()} is missing: give it on the command line, or as {name} in the "
                              f"--config file")
    if (args.tokenizer is None) != (args.corpus is None):
        raise XtrainError("give both TOKENIZER and CORPUS, or neither (for the shipped data)")
    launch = launch or detect_launch()
    world_size = launch.num_processes * local_world_for(launch, args.world_size)
    if args.tp == 1 and args.pp == 1 and args.batch < world_size:
        raise XtrainError(f"BATCH ({args.batch}) must be at least the world size ({world_size}): "
                          "every rank needs a sequence")
    if args.resume == NO_RESUME:  # over a --config file's resume: this run starts at step 1
        args.resume = None
    refuse_without_effect(args, given_options(parser, argv, file_values), launch)
    return TrainConfig(
        steps=args.steps, batch=args.batch, seq=args.seq,
        tokenizer=str(args.tokenizer or DEFAULT_TOKENIZER), corpus=str(args.corpus or DEFAULT_CORPUS),
        model=args.model, backend=args.backend, world_size=world_size, tp=args.tp, pp=args.pp,
        pp_schedule=args.pp_schedule, tp_classifier=args.tp_classifier,
        sequence_parallel=args.sequence_parallel, seed=args.seed,
        overfit_batch=args.overfit_batch,
        lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, lr_decay_steps=args.lr_decay_steps,
        lr_schedule=args.lr_schedule, cooldown_steps=args.cooldown_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        comm_timeout_s=args.comm_timeout, cpu_threads=args.cpu_threads, tf32=args.tf32,
        matmul=args.matmul,
        config=str(config or ""), report=args.report, log_every=args.log_every, profile_step=args.profile_step or 0,
        comm=args.comm, rdzv_bind=args.rdzv_bind, rdzv_advertise=args.rdzv_advertise,
        rdzv_timeout_s=TrainConfig.rdzv_timeout_s if args.rdzv_timeout is None else args.rdzv_timeout,
        save_dir=args.save_dir, save_every=args.save_every, keep_every=args.keep_every,
        resume=args.resume,
        init_from=args.init_from,
        eval_every=args.eval_every, eval_batches=args.eval_batches, val_corpus=args.val_corpus or "",
        hellaswag=args.hellaswag or "", metrics=args.metrics, tensorboard=args.tensorboard,
        wandb=args.wandb,
        sample_every=args.sample_every,
        sample_tokens=args.sample_tokens or TrainConfig.sample_tokens, sample_prompt=args.sample_prompt,
        grad_sync=args.grad_sync, bucket_mb=args.bucket_mb, comm_priority=args.comm_priority,
        grad_compress=args.grad_compress, zero=args.zero,
        zero3_prefetch=args.zero3_prefetch,
        powersgd_rank=args.powersgd_rank, powersgd_start_step=args.powersgd_start_step,
        grad_accum=args.grad_accum, all_reduce=args.all_reduce, dtype=args.dtype, attention=args.attention,
        recompute=args.recompute, dropout=args.dropout,
        cuda_graph=args.cuda_graph, options=_options(parser, args),
    ).resolved()


# ------------------------------------------------------------------------------ options without effect
# An option that does something only beside another: (its flag, whether this run gives it an effect, the line
# that refuses it where not). One table, so that every such pair is refused alike; an option counts as given
# where the command line names it, or the --config file sets it to other than its default (a file a run wrote
# holds every option, the ones left to their defaults too).
_ALONE = "is for a job of several processes (started by torchrun, srun or mpirun); this one runs alone"
WITHOUT_EFFECT = [
    ("--save-every", lambda a, launch: bool(a.save_dir), "--save-every needs --save-dir"),
    ("--keep-every", lambda a, launch: bool(a.save_dir), "--keep-every needs --save-dir"),
    ("--min-lr", lambda a, launch: a.lr_schedule != "constant", "--min-lr has no effect with --lr-schedule constant"),
    # it would only move the warmup's default (a twentieth of it): say which option sets the warmup
    ("--lr-decay-steps", lambda a, launch: a.lr_schedule != "constant",
     "--lr-decay-steps is for a schedule that decays, not --lr-schedule constant; the warmup is --warmup-steps "
     "(default STEPS/20)"),
    ("--sample-tokens", lambda a, launch: bool(a.sample_every), "--sample-tokens needs --sample-every"),
    ("--sample-prompt", lambda a, launch: bool(a.sample_every), "--sample-prompt needs --sample-every"),
    ("--rdzv-bind", lambda a, launch: launch.multi_process, f"--rdzv-bind {_ALONE}"),
    ("--rdzv-advertise", lambda a, launch: launch.multi_process, f"--rdzv-advertise {_ALONE}"),
    ("--rdzv-timeout", lambda a, launch: launch.multi_process, f"--rdzv-timeout {_ALONE}"),
    ("--pp-schedule", lambda a, launch: a.pp > 1, "--pp-schedule has no effect without --pp (2 or more stages)"),
    ("--tp-classifier", lambda a, launch: a.tp > 1,
     "--tp-classifier has no effect without --tp (2 or more tensor-parallel ranks)"),
    ("--sequence-parallel", lambda a, launch: a.tp > 1,
     "--sequence-parallel has no effect without --tp (2 or more tensor-parallel ranks)"),
    ("--powersgd-rank", lambda a, launch: a.grad_compress == "powersgd",
     "--powersgd-rank has no effect without --grad-compress powersgd"),
    ("--powersgd-start-step", lambda a, launch: a.grad_compress == "powersgd",
     "--powersgd-start-step has no effect without --grad-compress powersgd"),
    # ZeRO-2 and -3 reduce-scatter each of their units (a block's half, ln_f, wpe, wte) as backward finishes it
    ("--bucket-mb", lambda a, launch: a.zero < 2,
     "--bucket-mb has no effect at --zero 2 and 3: each unit (a block's half, ln_f, wpe, wte) is reduce-scattered "
     "as backward finishes it"),
    ("--bucket-mb", lambda a, launch: a.grad_sync == "bucketed",
     "--bucket-mb has no effect without --grad-sync bucketed"),
    ("--comm-priority", lambda a, launch: ddp.has_comm_thread(a),
     "--comm-priority has no effect without a communication thread (--grad-sync bucketed, or --zero 2 or 3)"),
]
_NOT_GIVEN = object()


def given_options(parser: argparse.ArgumentParser, argv: list[str], file_values: dict) -> set[str]:
    """The dests the command line sets (parsed again with every default a marker), and those the --config
    file sets to other than their built-in defaults (`file_values`, from apply_config_file)."""
    defaults = {action: action.default for action in parser._actions}
    try:
        for action in defaults:
            action.default = _NOT_GIVEN
        parsed = vars(parser.parse_intermixed_args(argv))
    finally:
        for action, default in defaults.items():
            action.default = default
    return ({dest for dest, value in parsed.items() if value is not _NOT_GIVEN}
            | {dest for dest, (default, value) in file_values.items() if value != default})


def refuse_without_effect(args: argparse.Namespace, given: set[str], launch: Launch) -> None:
    """One line for the first option of WITHOUT_EFFECT given where this run gives it no effect."""
    for flag, in_effect, line in WITHOUT_EFFECT:
        if flag.removeprefix("--").replace("-", "_") in given and not in_effect(args, launch):
            raise XtrainError(line)


def _options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Every argument's value as the run uses it, keyed for a --config file, paths as they were given (a
    relative path stays relative); nothing for an option left to its derived default (None), nor for
    TOKENIZER and CORPUS where they were not given: the shipped data, wherever this copy is installed."""
    options = {}
    for key, action in config_actions(parser).items():
        value = getattr(args, action.dest)
        if value is not None:
            options[key] = value
    return options


def profile_table(profile: dict) -> str:
    """The profiled step's ops on rank 0, slowest first, and its collectives: the time between ops holds
    the host's own work and the communication that backward did not hide."""
    return (f"profile of step {profile['step']} (rank 0, {profile['step_ms']:.1f} ms):\n"
            + rows_markdown(profile["ops"])
            + f"collectives: {profile['comm_ms']:.2f} ms inside them (all of rank 0's threads), "
              f"{profile['exposed_comm_ms']:.2f} ms waited for by rank 0's own thread (in the gaps above)")


def main(argv=None) -> int:
    code = run_command(PROG, lambda: _main(sys.argv[1:] if argv is None else argv))
    if code and code != STOPPED:
        # under mpirun a process that gives up must take the job with it, or its peers wait in MPI
        from ..comm.mpi import abort_job
        abort_job(code)
    return code


def _rendezvous_options(argv: list[str]) -> dict:
    """--rdzv-bind, --rdzv-advertise and --rdzv-timeout from a command line that did not parse: where to tell
    the other processes about it (behind NAT the default address may not reach rank 0) and for how long.
    Their defaults where they are missing, or are what is wrong."""
    p = OneLineParser(add_help=False, allow_abbrev=False)
    p.add_argument("--rdzv-bind", dest="bind")
    p.add_argument("--rdzv-advertise", dest="advertise")
    p.add_argument("--rdzv-timeout", dest="timeout_s", type=timeout_seconds,
                   default=TrainConfig.rdzv_timeout_s)
    try:
        options = vars(p.parse_known_args(argv)[0])
    except XtrainError:
        options = vars(p.parse_args([]))
    return {**options, "timeout_s": min(options["timeout_s"], 30.0)}


def _main(argv: list[str]) -> int:
    try:
        cfg = parse_config(argv)
    except XtrainError as err:  # a bad argument on one node: the other processes learn it now, not at their timeout
        with contextlib.suppress(XtrainError):
            report_failure_before_world(detect_launch(), str(err), **_rendezvous_options(argv), wait=False)
        raise
    try:
        report = train(cfg)
    except MachineWide:
        if detect_launch().local_rank != 0:  # the machine's first process says it for all of them
            return 2
        raise
    except RunComplete as done:
        if detect_launch().process_rank == 0:
            print(done)
        return 0
    except RankFailed as e:
        if isinstance(e.error, CommAborted):  # every rank here only saw the abort: the line says whose failure it was
            say_line(f"{command_name(PROG)}: error: rank {e.rank} stopped: {e.error}")
        else:
            detail = str(e.error) if isinstance(e.error, XtrainError) else f"{type(e.error).__name__}: {e.error}"
            print(f"{command_name(PROG)}: error: rank {e.rank} failed: {detail}", file=sys.stderr)
        if os.environ.get("XTRAIN_TRACEBACK"):
            import traceback
            traceback.print_exception(e.error)
        return 1
    stopped = report["stopped"]
    if report["process_rank"] != 0:  # one process writes and reports for the job
        return STOPPED if stopped else 0
    if cfg.report:
        files.write_atomic(cfg.report, json.dumps(report, indent=1) + "\n", "--report")
        if not files.written_in_place(Path(cfg.report)):  # a file, not a pipe or a device: its folder has room
            files.write_atomic(config_beside(cfg.report), cfg.options_toml(), "--report's configuration")
    if cfg.profile_step:
        print(profile_table(report["profile"]))
    val = f", val {report['val_losses'][-1][1]:.4f}" if report["val_losses"] else ""
    val += f", hellaswag {report['hellaswag'][-1][1]:.4f}" if report["hellaswag"] else ""
    pools = list(report["memory"].get("gpu_pool_bytes", {}).values())
    gpu = f", GPU memory held {'up to ' if len(pools) > 1 else ''}{memory.gib(max(pools))}" if pools else ""
    utilisation = f", MFU {100 * report['mfu']:.1f}%" if report["mfu"] is not None else ""
    head = f"stopped after step {stopped['step']} of {cfg.steps}" if stopped else "done"
    print(f"{head}: loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}{val}, "
          f"{report['ms_per_step']:.1f} ms/step, {report['tokens_per_s']:.0f} tokens/s{utilisation}, "
          f"peak RSS {memory.gib(report['memory']['peak_rss_bytes'])}{gpu}"
          + (f", report {cfg.report}" if cfg.report else ""))
    if stopped:
        resume = "" if cfg.resume == AUTO_RESUME else f" with --resume {cfg.save_dir}"  # --resume auto has it
        where = (f"checkpoint '{cfg.save_dir}' holds step {stopped['step']}: the same command{resume} goes on from "
                 "there" if cfg.save_dir else "nothing was saved (no --save-dir)")
        print(f"{PROG}: stopped by {stopped['signal'] or 'a signal to another process'}: {where}", file=sys.stderr)
        return STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
