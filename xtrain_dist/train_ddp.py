"""The command line: python -m xtrain_dist.train_ddp STEPS BATCH SEQ [TOKENIZER CORPUS] [options]

Checks the input, loads the corpus once, starts one rank per thread, prints a progress line per
step and writes the report. Any problem with the input ends in one line and exit status 2; a rank
that fails ends the run with one line naming the rank and exit status 1; SIGTERM or SIGUSR1 ends it
after the step its ranks are in, saved, with exit status 143 (StopRequest).
"""

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
from threadpoolctl import threadpool_limits

from . import checkpoint, ddp, evaluate, files, hellaswag, memory, metrics, precision, sample
from .backend import BACKENDS, MATMULS, rank_device
from .cli import (
    OneLineParser,
    non_empty_path,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    run_command,
    utf8_text,
)
from .comm import CommAborted
from .comm.world import choose_engine, config_fingerprint, open_world, report_failure_before_world
from .config import PRESETS, TrainConfig, model_config
from .data import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from .errors import XtrainError
from .launch import RankFailed, run_thread_ranks
from .launch_env import Launch, detect_launch, gpu_for, local_world_for
from .model import ATTENTIONS, RECOMPUTE_LEVELS, check_recompute
from .optim import LR_SCHEDULES, check_schedule
from .profile import mfu, peak_for, rows_markdown
from .train import train_rank

PROG = "train_ddp"
# what schedulers send before they kill: Kubernetes, docker stop, torchrun and mpirun pass on SIGTERM, and
# SLURM's `--signal=USR1@SECONDS` sends SIGUSR1 that long before a job's time limit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOPPED = 128 + signal.SIGTERM  # the exit status of every process of a job a stop signal ended (143)
AUTO_RESUME = "auto"  # --resume auto


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=f"python -m xtrain_dist.{PROG}",
                      description="Data-parallel GPT-2 training: one rank per thread (per GPU with --backend cuda).")
    p.add_argument("steps", metavar="STEPS", type=positive_int, help="optimizer steps to run")
    p.add_argument("batch", metavar="BATCH", type=positive_int, help="sequences per step, all ranks together")
    p.add_argument("seq", metavar="SEQ", type=positive_int, help="tokens per sequence")
    # non_empty_path: an empty one would read as "not given" and quietly train on the shipped data
    p.add_argument("tokenizer", metavar="TOKENIZER", nargs="?", type=non_empty_path,
                   help=f"tokenizer.json (default {DEFAULT_TOKENIZER})")
    p.add_argument("corpus", metavar="CORPUS", nargs="?", type=non_empty_path,
                   help=f"UTF-8 text, or llm.c token files: one, or a quoted glob pattern (default {DEFAULT_CORPUS})")
    p.add_argument("--backend", choices=BACKENDS, default="numpy")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks in the job, all processes together (default: one per process, 1 without a launcher)")
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--seed", type=non_negative_int, default=1337)
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
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1)
    p.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="global norm clip; 0 disables")
    p.add_argument("--comm-timeout", type=positive_float, default=300.0, help="seconds a rank may wait in a collective")
    p.add_argument("--tf32", action="store_true", help="cuda: TF32 tensor-core matmuls")
    p.add_argument("--matmul", choices=MATMULS, default="cublas",
                   help="cuda: cublaslt adds a linear layer's bias in the product's epilogue, rounding once, "
                        "instead of a kernel after a float32 product (default cublas)")
    p.add_argument("--cpu-threads", type=positive_int, default=None,
                   help="BLAS threads per rank (default: cores / ranks)")
    p.add_argument("--report", type=non_empty_path, default=None, help="write a JSON report here")
    p.add_argument("--log-every", type=positive_int, default=1)
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
    procs.add_argument("--rdzv-timeout", type=positive_float, default=None,
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
                        "command for a job's start and its requeues)")
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
    sync.add_argument("--grad-compress", choices=ddp.COMPRESSIONS, default="none",
                      help="bf16: round gradients to bfloat16 for the reduction")
    sync.add_argument("--zero", type=int, choices=(0, 1), default=0, help="1: shard the optimizer state (ZeRO-1)")
    sync.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    prec = p.add_argument_group("precision and memory (see README: Precision)")
    prec.add_argument("--attention", choices=ATTENTIONS, default="standard",
                      help="flash: keep one log-sum-exp per row instead of the T x T probabilities and recompute "
                           "them in backward (cuda: a fused kernel, --dtype bf16, 64-channel heads)")
    prec.add_argument("--recompute", type=int, choices=RECOMPUTE_LEVELS, default=0,
                      help="what backward computes again instead of forward keeping it: 1 each block's GELU "
                           "output, 2 also its layernorm outputs (same bits, less memory; default 0: nothing)")
    prec.add_argument("--dtype", choices=precision.DTYPES, default="fp32",
                      help="bf16: bfloat16 activations and matmuls, float32 master weights, gradients and "
                           "optimizer state (default fp32)")
    return p


def parse_config(argv, launch: Launch | None = None) -> TrainConfig:
    args = build_parser().parse_intermixed_args(argv)  # TOKENIZER CORPUS may come after options too
    if (args.tokenizer is None) != (args.corpus is None):
        raise XtrainError("give both TOKENIZER and CORPUS, or neither (for the shipped data)")
    launch = launch or detect_launch()
    world_size = launch.num_processes * local_world_for(launch, args.world_size)
    if args.batch < world_size:
        raise XtrainError(f"BATCH ({args.batch}) must be at least the world size ({world_size}): "
                          "every rank needs a sequence")
    for flag, value in (("--save-every", args.save_every), ("--keep-every", args.keep_every)):
        if value and not args.save_dir:
            raise XtrainError(f"{flag} needs --save-dir")
    if args.min_lr is not None and args.lr_schedule == "constant":
        raise XtrainError("--min-lr has no effect with --lr-schedule constant")
    if args.lr_decay_steps is not None and args.lr_schedule == "constant":
        # it would only move the warmup's default (a twentieth of it): say which option sets the warmup
        raise XtrainError("--lr-decay-steps is for a schedule that decays, not --lr-schedule constant; "
                          "the warmup is --warmup-steps (default STEPS/20)")
    for flag, value in (("--sample-tokens", args.sample_tokens), ("--sample-prompt", args.sample_prompt)):
        if value and not args.sample_every:
            raise XtrainError(f"{flag} needs --sample-every")
    for flag, value in (("--rdzv-bind", args.rdzv_bind), ("--rdzv-advertise", args.rdzv_advertise),
                        ("--rdzv-timeout", args.rdzv_timeout)):
        if value is not None and not launch.multi_process:  # it would be ignored: no other process to meet
            raise XtrainError(f"{flag} is for a job of several processes (started by torchrun, srun or mpirun); "
                              "this one runs alone")
    return TrainConfig(
        steps=args.steps, batch=args.batch, seq=args.seq,
        tokenizer=str(args.tokenizer or DEFAULT_TOKENIZER), corpus=str(args.corpus or DEFAULT_CORPUS),
        model=args.model, backend=args.backend, world_size=world_size, seed=args.seed, overfit_batch=args.overfit_batch,
        lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, lr_decay_steps=args.lr_decay_steps,
        lr_schedule=args.lr_schedule, cooldown_steps=args.cooldown_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        comm_timeout_s=args.comm_timeout, cpu_threads=args.cpu_threads, tf32=args.tf32,
        matmul=args.matmul,
        report=args.report, log_every=args.log_every, profile_step=args.profile_step or 0,
        comm=args.comm, rdzv_bind=args.rdzv_bind, rdzv_advertise=args.rdzv_advertise,
        rdzv_timeout_s=TrainConfig.rdzv_timeout_s if args.rdzv_timeout is None else args.rdzv_timeout,
        save_dir=args.save_dir, save_every=args.save_every, keep_every=args.keep_every, resume=args.resume,
        init_from=args.init_from,
        eval_every=args.eval_every, eval_batches=args.eval_batches, val_corpus=args.val_corpus or "",
        hellaswag=args.hellaswag or "", metrics=args.metrics, sample_every=args.sample_every,
        sample_tokens=args.sample_tokens or TrainConfig.sample_tokens, sample_prompt=args.sample_prompt,
        grad_sync=args.grad_sync, bucket_mb=args.bucket_mb, grad_compress=args.grad_compress, zero=args.zero,
        grad_accum=args.grad_accum, dtype=args.dtype, attention=args.attention, recompute=args.recompute,
    ).resolved()


def check_config(cfg: TrainConfig, corpus: Corpus) -> None:
    """What needs the corpus to check: the model fits the sequence, the text fits the batch."""
    model = model_config(cfg.model, corpus.vocab_size)
    if cfg.seq > model.n_ctx:
        raise XtrainError(f"SEQ ({cfg.seq}) exceeds the context length of model '{cfg.model}' ({model.n_ctx})")
    corpus.check_seq(cfg.seq)
    if cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise XtrainError(f"--min-lr ({cfg.min_lr:g}) must not exceed --lr ({cfg.lr:g}): the schedule decays from "
                          "the one to the other")
    check_schedule(cfg)
    ddp.check_config(cfg)
    precision.check_config(cfg)
    check_recompute(cfg.recompute)
    if cfg.attention == "flash" and cfg.backend == "cuda":
        from .backend.cuda_ops import check_flash_attention
        check_flash_attention(cfg.dtype, model.n_embd // model.n_head, cfg.model)


def check_outputs(cfg: TrainConfig) -> None:
    """Refuse a run that would write over its own files: --report or --metrics on the tokenizer, the corpus
    or each other, or inside the folder of --resume or --init-from (which it reads) or of --save-dir (which
    every save replaces whole, so the corpus may not lie there either). Files are compared, not names, so a
    relative path, a symlink or a hard link is caught too."""
    outputs = [(flag, path) for flag, path in (("--report", cfg.report), ("--metrics", cfg.metrics)) if path]
    inputs = [("the tokenizer", cfg.tokenizer), ("the corpus", cfg.corpus), ("the validation corpus", cfg.val_corpus),
              ("the --hellaswag file", cfg.hellaswag)]
    for flag, out in outputs:
        files.refuse_output_on_inputs(out, flag, inputs, "the run would write into its own input")
    if len(outputs) == 2 and files.same_file(cfg.report, cfg.metrics):
        raise XtrainError(f"--report '{cfg.report}' and --metrics '{cfg.metrics}' are the same file: the report "
                          "would replace the metrics")
    for flag, folder in (("--resume", cfg.resume), ("--init-from", cfg.init_from)):
        for name, path in outputs if folder else []:
            if files.inside(path, folder):
                raise XtrainError(f"{name} '{path}' is inside {flag} '{folder}': the run would write into the "
                                  "checkpoint it reads")
    inputs_in_run = [("corpus", cfg.corpus), ("--val-corpus", cfg.val_corpus), ("--hellaswag", cfg.hellaswag)]
    for name, path in [*outputs, *inputs_in_run] if cfg.save_dir else []:
        if path and files.inside(path, cfg.save_dir):
            raise XtrainError(f"{name} '{path}' is inside --save-dir '{cfg.save_dir}': every checkpoint save "
                              "replaces that folder")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads_per_rank(ranks_on_node: int) -> int:
    """Share the cores among the rank threads of every process of the job on this node: BLAS threads
    beyond that only spin."""
    return max(1, available_cores() // ranks_on_node)


# what every process of a run must agree on; paths and addresses may differ from node to node, and so may
# --recompute (a node short of memory may recompute: the bits are the same) and the sampling options (only
# the process of rank 0 draws)
_PER_PROCESS_FIELDS = {"tokenizer", "corpus", "val_corpus", "hellaswag", "init_from", "report", "metrics", "log_every",
                       "rdzv_bind", "rdzv_advertise", "cpu_threads", "profile_step", "recompute", "sample_every",
                       "sample_tokens", "sample_prompt", "extra"}


def train(cfg: TrainConfig, corpus: Corpus | None = None, log=print, launch: Launch | None = None,
          stop: "StopRequest | None" = None) -> dict:
    """Run this process's share of a training job (all of it without a launcher); return the report
    (a JSON-ready dict; `process_rank` says whether this process is the one that writes it). `stop`: what
    ends the run early when set (by default, a StopRequest that SIGTERM and SIGUSR1 set)."""
    launch = launch or detect_launch()
    local_world = local_world_for(launch, cfg.world_size)
    try:
        ready = _prepare(cfg, corpus, launch, local_world, log)
    except RunComplete:  # no failure: every process finds the same checkpoint and ends without the others
        raise
    except Exception as err:
        # this process cannot start: tell the others now, or they wait for it until --rdzv-timeout
        reason = str(err) if isinstance(err, XtrainError) else f"{type(err).__name__}: {err}"
        report_failure_before_world(launch, reason, bind=cfg.rdzv_bind, advertise=cfg.rdzv_advertise,
                                    timeout_s=min(cfg.rdzv_timeout_s, 30.0))
        raise
    cfg, corpus, devices = ready.cfg, ready.corpus, ready.devices
    world = open_world(ready.engine, launch=launch, local_world=local_world, timeout_s=cfg.comm_timeout_s,
                       rdzv_bind=cfg.rdzv_bind, rdzv_advertise=cfg.rdzv_advertise, rdzv_timeout_s=cfg.rdzv_timeout_s,
                       fingerprint=ready.fingerprint, devices=None if cfg.backend != "cuda" else devices,
                       log=lambda line: print(f"{PROG}: {line}", file=sys.stderr))

    # the checkpoint _prepare verified, bytes and all: the ranks restore from it without reading it again
    shared_resume = checkpoint.shared_restore(cfg.resume, local_world, ready.resume_from) if cfg.resume else None
    shared_init = checkpoint.Shared(local_world, ready.init_weights, path=cfg.init_from) if cfg.init_from else None
    ready.init_weights = None  # the ranks' last load lets the host copy go

    peak_flops = job_peak_flops(cfg, devices, launch)
    stop = StopRequest(cfg.save_dir) if stop is None else stop

    def rank_fn(local, comm):
        result = train_rank(comm.rank, comm, cfg, corpus, device=devices[local], log=log, resume=shared_resume,
                            init=shared_init, hellaswag=ready.hellaswag, peak_flops=peak_flops, stop=stop)
        return result, every_ranks_facts(comm, result, cfg.backend)

    t0 = time.perf_counter()
    try:
        with threadpool_limits(cfg.cpu_threads or cpu_threads_per_rank(local_world * launch.local_processes),
                               user_api="blas"), stop.on_signals():
            outcomes = run_thread_ranks(local_world, rank_fn, timeout_s=cfg.comm_timeout_s, group=world)
    except RankFailed as e:
        world.abort("another process failed")  # peers learn at once (TCP: closed sockets; NCCL: aborted comms)
        raise RankFailed(world.global_rank(e.rank), e.error) from None
    except BaseException:
        world.abort("another process failed")
        raise
    finally:
        world.close()
    wall = time.perf_counter() - t0
    results = [result for result, _ in outcomes]
    lead = results[0]
    timed = lead.step_ms[1:] or lead.step_ms  # the first step pays for warm-up
    ms = float(np.mean(timed))
    mcfg = model_config(cfg.model, corpus.vocab_size)
    return {
        "config": cfg.to_dict(),
        "dtype": cfg.dtype,
        "model": {"preset": cfg.model, **vars(mcfg),
                  "num_params": lead.num_params},
        "launch": {"kind": launch.kind, "processes": launch.num_processes, "threads_per_process": local_world,
                   "comm": ready.engine},
        "process_rank": launch.process_rank,
        "start_step": lead.start_step,  # losses[i] is the loss of step start_step + i + 1
        # a stop signal ended the run after this step (the signal: None where it reached another process)
        "stopped": {"step": lead.stopped_at, "signal": stop.signal_name} if lead.stopped_at else None,
        "losses": lead.losses,
        "val_losses": lead.val_losses,
        "hellaswag": lead.hellaswag,
        "samples": lead.samples,
        "grad_norms": lead.grad_norms,
        "lrs": lead.lrs,
        "step_ms": lead.step_ms,
        "ms_per_step": ms,
        "tokens_per_s": cfg.batch * cfg.seq / ms * 1e3,
        "mfu": mfu(lead.step_flops, ms, peak_flops) if peak_flops else None,  # of the mean step
        "wall_s": wall,
        **ddp.report_fields(cfg, results),
        # every rank of the job, in rank order, also those of other processes
        **outcomes[0][1],
        # memory: what rank 0 holds at least, by part (memory.py), and what this process took at its peak
        "memory": {"rank0_bytes_at_least": asdict(memory.rank_memories(mcfg, cfg, act_itemsize(cfg))[0]),
                   "peak_rss_bytes": memory.peak_rss_bytes(), **gpu_memory(cfg, devices)},
        **({"profile": profile_of(lead, cfg.profile_step)} if cfg.profile_step else {}),
    }


class StopRequest(threading.Event):
    """Set by the first SIGTERM or SIGUSR1 while the ranks train (`on_signals`); train_rank then ends the run
    after the step every rank of the job is in, with a checkpoint in --save-dir. A second signal ends the
    process at once, as the first would have without this."""

    def __init__(self, save_dir: str | None):
        super().__init__()
        self.save_dir = save_dir
        self.signal_name: str | None = None  # of the signal that set it

    @contextlib.contextmanager
    def on_signals(self):
        """Catch the stop signals for the duration (only the main thread may: train() called from another
        thread keeps the process's handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._caught) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _caught(self, signum, frame) -> None:
        for s in STOP_SIGNALS:  # the next one ends the process
            signal.signal(s, signal.SIG_DFL)
        self.signal_name = signal.Signals(signum).name
        self.set()
        saving = f"saving a checkpoint in '{self.save_dir}'" if self.save_dir else "no --save-dir: nothing is saved"
        print(f"{PROG}: {self.signal_name}: stopping after the step the ranks are in ({saving}); send it again to "
              "end now", file=sys.stderr, flush=True)


def job_peak_flops(cfg: TrainConfig, devices: list, launch: Launch) -> float | None:
    """MFU's denominator: the dense peak FLOP/s, at the run's precision, of all the GPUs of the job (this
    process's distinct GPUs, virtual ranks sharing one counting once, times the processes, which all hold
    as many). None on the CPU, whose peak we do not know, and on a GPU profile.PEAK_TFLOPS does not list."""
    if cfg.backend != "cuda":
        return None
    from .backend.cuda_ops import device_name
    peaks = [peak_for(device_name(device)) for device in sorted(set(devices))]
    if not peaks or None in peaks:
        return None
    precision = "bf16" if cfg.dtype == "bf16" else "tf32" if cfg.tf32 else "fp32"
    return sum(peak[precision] for peak in peaks) * 1e12 * launch.num_processes


def gpu_memory(cfg: TrainConfig, devices: list) -> dict:
    """On GPUs, what CuPy's pool held on each of this process's GPUs at the end of the run (cuda_ops.pool_bytes),
    keyed by device; the ranks sharing a GPU share its pool."""
    if cfg.backend != "cuda":
        return {}
    from .backend.cuda_ops import pool_bytes
    return {"gpu_pool_bytes": {str(device): pool_bytes(device) for device in sorted(set(devices))}}


def profile_of(lead, step: int) -> dict:
    """The report's --profile-step section: the step's time and collectives on local rank 0, and its ops."""
    i = step - lead.start_step - 1
    return {"step": step, "step_ms": lead.step_ms[i], "comm_ms": lead.comm_s[i] * 1e3,
            "exposed_comm_ms": lead.exposed_comm_s[i] * 1e3, "ops": lead.profile}


@dataclass
class Prepared:
    """What a process checked and loaded before it meets the others."""
    engine: str                 # the communicator it joins the world with
    corpus: Corpus
    devices: list               # each local rank's device
    cfg: TrainConfig            # with what the checks settled (evaluation switched off for a short split)
    fingerprint: bytes          # of what every process must agree on (config_fingerprint)
    resume_from: object         # the verified checkpoint to resume from, or None
    init_weights: dict | None   # the --init-from parameters
    hellaswag: list | None      # the --hellaswag examples


def _prepare(cfg: TrainConfig, corpus: Corpus | None, launch: Launch, local_world: int, log) -> Prepared:
    """Everything a process checks and loads before it meets the others, or one XtrainError naming what
    is wrong."""
    if corpus is None:  # a TrainConfig made in code trains on the shipped data where it names none, as the CLI does
        cfg = replace(cfg, tokenizer=cfg.tokenizer or str(DEFAULT_TOKENIZER), corpus=cfg.corpus or str(DEFAULT_CORPUS))
    auto_resume = cfg.resume == AUTO_RESUME
    cfg = resolve_auto_resume(cfg)
    check_outputs(cfg)
    gpus = 0
    if cfg.backend == "cuda":  # a missing CUDA is one clean line, before anything starts
        from .backend.cuda_ops import device_count
        gpus = device_count()
    engine = choose_engine(cfg.comm, cfg.backend, launch, local_world, gpus)
    corpus = corpus or Corpus.load(cfg.tokenizer, cfg.corpus, val_path=cfg.val_corpus or None)
    check_config(cfg, corpus)
    # devices are checked before any thread starts, so a missing CUDA is one clean line. NCCL ranks
    # take a GPU each (the process's slice of its node's GPUs); thread ranks of one process take the
    # visible GPUs in turn, several virtual ranks sharing one when the world is larger
    if engine == "nccl":
        devices = [gpu_for(launch, local_world, local, gpus) for local in range(local_world)]
    else:
        devices = [rank_device(cfg.backend, local) for local in range(local_world)]
    # checkpoints, evaluation, metrics: fail before training rather than after it
    if cfg.save_dir and launch.process_rank == 0:
        if note := checkpoint.prepare_save_dir(cfg.save_dir):
            log(note)
        checkpoint.refuse_another_runs_checkpoint(cfg.save_dir, cfg.resume)
        if auto_resume and not cfg.resume:  # said once --save-dir is known to take the run's checkpoints
            log(f"--resume {AUTO_RESUME}: no checkpoint in '{cfg.save_dir}' yet: starting at step 1")
    if cfg.metrics:
        metrics.check_path(cfg.metrics)
    if cfg.report and launch.process_rank == 0:
        files.check_writable(cfg.report, "--report")
    cfg = evaluate.check(cfg, corpus, log)
    examples = hellaswag.load(cfg, corpus) if cfg.hellaswag else None
    if cfg.sample_every and launch.process_rank == 0:  # where rank 0 will draw: a prompt it cannot encode fails now
        sample.prompt_ids(corpus.tokenizer, cfg.sample_prompt, cfg.tokenizer, "--sample-prompt")
    if cfg.resume and cfg.init_from:
        raise XtrainError("--init-from and --resume both say where the weights start: give one")
    first, resume_from = 1, None
    if cfg.resume:
        try:
            step, notes, resume_from = checkpoint.check_resume(cfg, corpus)
        except checkpoint.AlreadyTrained as done:
            if not auto_resume:  # an explicit --resume asks for more steps than it gave
                raise
            raise RunComplete(f"--resume {AUTO_RESUME}: checkpoint '{cfg.save_dir}' is at step {done.step} and "
                              f"STEPS is {cfg.steps}: nothing left to train") from None
        first = step + 1
        if launch.process_rank == 0:
            for line in [f"resuming '{cfg.resume}' after step {step}", *notes]:
                log(line)
    if cfg.keep_every and launch.process_rank == 0:
        checkpoint.refuse_existing_kept_folders(cfg, first - 1)
    init_weights = check_init_from(cfg, corpus) if cfg.init_from else None
    if init_weights is not None and launch.process_rank == 0:
        log(f"starting from the weights in '{cfg.init_from}'")
    if cfg.profile_step and not first <= cfg.profile_step <= cfg.steps:
        raise XtrainError(f"--profile-step {cfg.profile_step} is not a step of this run (it runs steps {first} "
                          f"to {cfg.steps})")
    for note in check_memory(cfg, model_config(cfg.model, corpus.vocab_size), local_world * launch.local_processes,
                             devices):
        if launch.local_rank == 0:  # one process a machine says it
            log(note)
    warn_oversubscribed(cfg, local_world * launch.local_processes, log)
    if launch.process_rank == 0:
        where = f" on GPUs {devices}" if cfg.backend == "cuda" else ""
        processes = f" in {launch.num_processes} processes ({launch.kind}, {engine})" if launch.multi_process else ""
        products = (" with TF32 products" if cfg.tf32 else "") + \
            (", biases in cuBLASLt's epilogue" if cfg.matmul == "cublaslt" else "")
        log(f"{cfg.model}: {model_config(cfg.model, corpus.vocab_size)} | {cfg.backend} backend, {cfg.dtype}"
            f"{products}, {cfg.world_size} rank(s){processes}{where}, batch {cfg.batch} x {cfg.seq} tokens")
    # the files' paths may differ from node to node; the token ids read from them may not, or ranks would
    # train on different data with nothing to say so
    same_everywhere = {k: v for k, v in cfg.to_dict().items() if k not in _PER_PROCESS_FIELDS}
    if init_weights is not None:  # so are the weights every rank starts from
        same_everywhere["init_params"] = checkpoint.params_sha256(init_weights,
                                                                  model_config(cfg.model, corpus.vocab_size))
    if examples is not None:
        same_everywhere["hellaswag_examples"] = hellaswag.sha256(examples)
    fingerprint = config_fingerprint({**same_everywhere, "train_tokens": corpus.train_sha256,
                                      "val_tokens": corpus.val_sha256})
    return Prepared(engine, corpus, devices, cfg, fingerprint, resume_from, init_weights, examples)


class RunComplete(XtrainError):
    """--resume auto found the run already trained to STEPS: a requeued job that ended after its last save
    runs its command once more, and that is success (exit status 0), not bad input."""


def resolve_auto_resume(cfg: TrainConfig) -> TrainConfig:
    """--resume auto: from the checkpoint in --save-dir where there is one (the weights of --init-from were
    the first start's, and the checkpoint has moved on from them), else a first start. So a job requeued
    after a stop signal runs the very command it started with. Every process decides alone, and the
    configuration they compare at the rendezvous holds the outcome: processes that see different
    --save-dir contents are refused there. (train says which it was, once --save-dir has passed its checks.)"""
    if cfg.resume != AUTO_RESUME:
        return cfg
    if not cfg.save_dir:
        raise XtrainError(f"--resume {AUTO_RESUME} continues from the checkpoint in --save-dir: give --save-dir")
    if checkpoint.is_checkpoint(cfg.save_dir):
        return replace(cfg, resume=cfg.save_dir, init_from=None)
    return replace(cfg, resume=None)


def _shape(c) -> str:
    return f"{c.n_layer} layers, {c.n_head} heads, width {c.n_embd}, context {c.n_ctx}, vocabulary {c.vocab_size}"


def check_init_from(cfg: TrainConfig, corpus: Corpus) -> dict:
    """--init-from: the pretrained parameters, checked to be the model this run trains with this tokenizer."""
    pretrained = checkpoint.open_pretrained(cfg.init_from)
    theirs, ours = pretrained.gpt_config(), model_config(cfg.model, corpus.vocab_size)
    if theirs != ours:
        if theirs.vocab_size != corpus.vocab_size:
            hint = f"train with the tokenizer it was trained with (its vocabulary of {theirs.vocab_size})"
        elif preset := next((p for p in PRESETS if model_config(p, theirs.vocab_size) == theirs), None):
            hint = f"pass --model {preset}"
        else:
            hint = "no --model preset has its shape"
        raise XtrainError(f"--init-from '{cfg.init_from}' holds a GPT-2 of {_shape(theirs)}; --model {cfg.model} "
                          f"with this tokenizer is {_shape(ours)}: {hint}")
    return pretrained.pretrained_state(ours)


def act_itemsize(cfg: TrainConfig) -> int:
    """Bytes of an activation: bf16 on a GPU is 2, float32 and numpy's bf16 emulation (in float32) 4."""
    return 2 if cfg.backend == "cuda" and cfg.dtype == "bf16" else 4


def check_memory(cfg: TrainConfig, config, ranks_on_node: int, devices: list) -> list[str]:
    """Refuse a run whose ranks cannot fit in the memory they share (memory.py): on the CPU, this machine's
    for all the job's ranks on it; on GPUs, each GPU's for the ranks placed on it. The job's smallest
    per-rank figures are used, so whichever ranks are here, the bound holds. Returns the notes for runs
    that fit only if their ranks' steps do not overlap."""
    needs = sorted(memory.rank_memories(config, cfg, act_itemsize(cfg)), key=lambda n: (n.persistent, n.activations))
    if cfg.backend != "cuda":
        note = memory.check_fits(needs[:ranks_on_node], memory.host_available_bytes(), "this machine", cfg)
        return [note] if note else []
    from .backend.cuda_ops import device_free_bytes
    notes = [memory.check_fits(needs[:devices.count(device)], device_free_bytes(device), f"GPU {device}", cfg)
             for device in sorted(set(devices))]
    return [note for note in notes if note]


def warn_oversubscribed(cfg: TrainConfig, ranks_on_node: int, log) -> None:
    """--cpu-threads asking for more BLAS threads than the cores is allowed (the user may know the machine
    better than its affinity mask), but said: OpenBLAS threads past the cores spin against each other, and
    a step on a 2-core machine ran 12x slower with 8 threads than with 2."""
    cores = available_cores()
    if cfg.backend == "numpy" and cfg.cpu_threads and cfg.cpu_threads * ranks_on_node > cores:
        log(f"note: --cpu-threads {cfg.cpu_threads} x {ranks_on_node} rank(s) on this machine is "
            f"{cfg.cpu_threads * ranks_on_node} BLAS threads on {cores} cores: threads beyond the cores slow "
            "the step down, often many times over (leave --cpu-threads out to share the cores)")


def every_ranks_facts(comm, result, backend: str) -> dict[str, list]:
    """Every rank's parameter digest and byte counts, gathered through the communicator, so across
    processes too: the report lists every rank of the job, not only this process's. Called on the rank's
    thread: with CUDA, on its device and stream."""
    if backend == "cuda":
        import cupy as xp
    else:
        xp = np
    counts = (result.optimizer_state_bytes, result.param_bytes, result.grad_bytes)
    mine = bytes.fromhex(result.param_sha256) + np.array(counts, "<i8").tobytes()  # 32 + 3 x 8 bytes
    everyone = xp.empty(len(mine) * comm.world_size, np.uint8)
    comm.all_gather(xp.asarray(np.frombuffer(mine, np.uint8)), everyone)
    raw = (everyone.get() if hasattr(everyone, "get") else everyone).tobytes()
    records = [raw[i:i + len(mine)] for i in range(0, len(raw), len(mine))]
    counts = [np.frombuffer(r[32:], "<i8").tolist() for r in records]
    return {"param_sha256": [r[:32].hex() for r in records],
            "optimizer_state_bytes": [c[0] for c in counts], "param_bytes": [c[1] for c in counts],
            "grad_bytes": [c[2] for c in counts]}


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
        from .comm.mpi import abort_job
        abort_job(code)
    return code


def _rendezvous_options(argv: list[str]) -> dict:
    """--rdzv-bind, --rdzv-advertise and --rdzv-timeout from a command line that did not parse: where to tell
    the other processes about it (behind NAT the default address may not reach rank 0) and for how long.
    Their defaults where they are missing, or are what is wrong."""
    p = OneLineParser(add_help=False, allow_abbrev=False)
    p.add_argument("--rdzv-bind", dest="bind")
    p.add_argument("--rdzv-advertise", dest="advertise")
    p.add_argument("--rdzv-timeout", dest="timeout_s", type=positive_float,
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
            report_failure_before_world(detect_launch(), str(err), **_rendezvous_options(argv))
        raise
    try:
        report = train(cfg)
    except RunComplete as done:
        if detect_launch().process_rank == 0:
            print(done)
        return 0
    except RankFailed as e:
        if isinstance(e.error, CommAborted):  # every rank here only saw the abort: the line says whose failure it was
            print(f"{PROG}: error: rank {e.rank} stopped: {e.error}", file=sys.stderr)
        else:
            detail = str(e.error) if isinstance(e.error, XtrainError) else f"{type(e.error).__name__}: {e.error}"
            print(f"{PROG}: error: rank {e.rank} failed: {detail}", file=sys.stderr)
        if os.environ.get("XTRAIN_TRACEBACK"):
            import traceback
            traceback.print_exception(e.error)
        return 1
    stopped = report["stopped"]
    if report["process_rank"] != 0:  # one process writes and reports for the job
        return STOPPED if stopped else 0
    if cfg.report:
        files.write_atomic(cfg.report, json.dumps(report, indent=1) + "\n", "--report")
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

