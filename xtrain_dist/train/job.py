"""A training job in this process: start its rank threads (train_rank each), catch the stop signals,
and gather the report.

train() runs this process's share of the job: the checks and loads of preflight.prepare, then the
world of communicators (comm/world.py), then one thread per local rank through launch.run_thread_ranks,
and last the report every rank's results make.
"""

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import asdict

import numpy as np
from threadpoolctl import threadpool_limits

from ..backend import numpy_ops
from ..checkpoint import resume, store
from ..comm.launch_env import Launch, detect_launch, local_world_for
from ..comm.rendezvous import report_failure_before_world
from ..comm.world import open_world
from ..config import TrainConfig, model_config
from ..data.corpus import Corpus
from ..errors import XtrainError
from ..parallel import ddp
from ..profile import mfu, peak_for
from . import memory
from .launch import RankFailed, run_thread_ranks
from .loop import train_rank
from .preflight import Prepared, RunComplete, act_itemsize, prepare

PROG = "train_ddp"


# what schedulers send before they kill: Kubernetes, docker stop, torchrun and mpirun pass on SIGTERM, and
# SLURM's `--signal=USR1@SECONDS` sends SIGUSR1 that long before a job's time limit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


STOPPED = 128 + signal.SIGTERM  # the exit status of every process of a job a stop signal ended (143)


def train(cfg: TrainConfig, corpus: Corpus | None = None, log=print, launch: Launch | None = None,
          stop: "StopRequest | None" = None) -> dict:
    """Run this process's share of a training job (all of it without a launcher) and return the report, a
    JSON-ready dict whose `process_rank` says whether this process is the one that writes it.

    Args:
        cfg: the run's configuration (cli.parse_config, or one made in code).
        corpus: the loaded corpus; by default read from cfg.tokenizer and cfg.corpus (the shipped data where
            a configuration made in code names none).
        log: where this process's lines go.
        launch: which launcher started the process (comm.launch_env.detect_launch by default).
        stop: what ends the run early when set; by default a StopRequest that SIGTERM and SIGUSR1 set.
    """
    launch = launch or detect_launch()
    local_world = local_world_for(launch, cfg.world_size)
    try:
        ready = prepare(cfg, corpus, launch, local_world, log)
    except RunComplete:  # no failure: every process finds the same checkpoint and ends without the others
        raise
    except Exception as err:
        # this process cannot start: tell the others now, or they wait for it until --rdzv-timeout
        reason = str(err) if isinstance(err, XtrainError) else f"{type(err).__name__}: {err}"
        report_failure_before_world(launch, reason, bind=cfg.rdzv_bind, advertise=cfg.rdzv_advertise,
                                    timeout_s=min(cfg.rdzv_timeout_s, 30.0), wait=False)
        raise
    try:  # the outputs stay this run's until it ends (preflight.prepare took them)
        return run_prepared(ready, launch, local_world, log, stop)
    finally:
        for lock in ready.locks:
            lock.release()


def run_prepared(ready: Prepared, launch: Launch, local_world: int, log, stop: "StopRequest | None") -> dict:
    """train() once the checks have passed: the world of communicators, the rank threads, the report."""
    cfg, corpus, devices = ready.cfg, ready.corpus, ready.devices
    world = open_world(ready.engine, launch=launch, local_world=local_world, timeout_s=cfg.comm_timeout_s,
                       rdzv_bind=cfg.rdzv_bind, rdzv_advertise=cfg.rdzv_advertise, rdzv_timeout_s=cfg.rdzv_timeout_s,
                       fingerprint=ready.fingerprint, devices=None if cfg.backend != "cuda" else devices,
                       log=lambda line: print(f"{PROG}: {line}", file=sys.stderr))

    # the checkpoint _prepare verified, bytes and all: the ranks restore from it without reading it again
    shared_resume = resume.shared_restore(cfg.resume, local_world, ready.resume_from) if cfg.resume else None
    shared_init = store.Shared(local_world, ready.init_weights, path=cfg.init_from) if cfg.init_from else None
    ready.init_weights = None  # the ranks' last load lets the host copy go

    peak_flops = job_peak_flops(cfg, devices, launch)
    stop = StopRequest(cfg.save_dir) if stop is None else stop

    def rank_fn(local, comm):
        result = train_rank(comm.rank, comm, cfg, corpus, device=devices[local], log=log, resume=shared_resume,
                            init=shared_init, hellaswag=ready.hellaswag, peak_flops=peak_flops, stop=stop)
        return result, every_ranks_facts(comm, result, cfg.backend)

    t0 = time.perf_counter()
    try:
        threads = cfg.cpu_threads or numpy_ops.CPU_THREADS_PER_RANK
        with threadpool_limits(threads, user_api="blas"), numpy_ops.op_threads(threads), stop.on_signals():
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
    step_ms = figures(lead.records, "ms")
    timed = step_ms[1:] or step_ms  # the first step pays for warm-up
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
        "losses": figures(lead.records, "loss"),  # the global batch's mean loss
        "val_losses": figures_at(lead.records, "val_loss"),
        "hellaswag": figures_at(lead.records, "hellaswag"),
        "samples": figures_at(lead.records, "sample"),  # rank 0 draws them
        "grad_norms": figures(lead.records, "grad_norm"),  # before clipping
        "lrs": figures(lead.records, "lr"),
        "step_ms": step_ms,
        "ms_per_step": ms,
        "tokens_per_s": cfg.batch * cfg.seq / ms * 1e3,
        "mfu": mfu(lead.step_flops, ms, peak_flops) if peak_flops else None,  # of the mean step
        "wall_s": wall,
        **ddp.report_fields(cfg, results),
        # --cuda-graph: whether rank 0's steps ran from a captured graph (train/graph.py), and why not
        "cuda_graph": lead.cuda_graph,
        # every rank of the job, in rank order, also those of other processes
        **outcomes[0][1],
        # memory: what rank 0 holds at least, by part (train/memory.py), and what this process took at its peak
        "memory": {"rank0_bytes_at_least": asdict(memory.rank_memories(mcfg, cfg, act_itemsize(cfg))[0]),
                   # one micro-batch's blocks on rank 0, as kept and as Korthikanti et al. 2022 count them
                   "rank0_block_activations": memory.block_activations(mcfg, cfg, act_itemsize(cfg)),
                   "peak_rss_bytes": memory.peak_rss_bytes(), **gpu_memory(cfg, devices)},
        **({"profile": profile_of(lead, cfg.profile_step)} if cfg.profile_step else {}),
    }


class StopRequest(threading.Event):
    """Set by the first SIGTERM or SIGUSR1 while the ranks train (`on_signals`); train_rank then ends the run
    after the step every rank of the job is in, with a checkpoint in --save-dir.

    Stop signals come in bursts: coreutils `timeout` sends SIGTERM to the child and then to its whole process
    group, and launchers and schedulers forward a signal that the group may also get. So a stop signal within
    GRACE_S of the first is the same request and changes nothing; one later than that is a deliberate second
    request and ends the process at once (the signal's default action), as the first would have without
    this."""

    GRACE_S = 2.0

    def __init__(self, save_dir: str | None):
        super().__init__()
        self.save_dir = save_dir
        self.signal_name: str | None = None  # of the signal that set it
        self._first_at: float | None = None  # when that signal was caught (time.monotonic)

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
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._first_at is not None:  # (not is_set(): a request from another process sets it too)
            if now - self._first_at < self.GRACE_S:
                print(f"{PROG}: {name} {now - self._first_at:.1f} s after the {self.signal_name}: the same request "
                      f"(a stop signal {self.GRACE_S:g} s or more after the first ends the process now)",
                      file=sys.stderr, flush=True)
                return
            for s in STOP_SIGNALS:  # a deliberate second request: end now, as the signal does by default
                signal.signal(s, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._first_at = now
        self.signal_name = name
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
    from ..backend.cuda.device import device_name
    peaks = [peak_for(device_name(device)) for device in sorted(set(devices))]
    if not peaks or None in peaks:
        return None
    precision = "bf16" if cfg.dtype == "bf16" else "tf32" if cfg.tf32 else "fp32"
    return sum(peak[precision] for peak in peaks) * 1e12 * launch.num_processes


def gpu_memory(cfg: TrainConfig, devices: list) -> dict:
    """On GPUs, what CuPy's pool held on each of this process's GPUs at the end of the run (device.pool_bytes),
    keyed by device; the ranks sharing a GPU share its pool."""
    if cfg.backend != "cuda":
        return {}
    from ..backend.cuda.device import pool_bytes
    return {"gpu_pool_bytes": {str(device): pool_bytes(device) for device in sorted(set(devices))}}


def figures(records: list[dict], key: str) -> list:
    """`key` of every step record (the report's per-step lists: losses, lrs, step times)."""
    return [record[key] for record in records]


def figures_at(records: list[dict], key: str) -> list[list]:
    """[step, `key`] of the step records that have it: the evaluations' figures, the samples drawn."""
    return [[record["step"], record[key]] for record in records if key in record]


def profile_of(lead, step: int) -> dict:
    """The report's --profile-step section: the step's time and collectives on local rank 0, and its ops."""
    record = lead.records[step - lead.start_step - 1]
    return {"step": step, "step_ms": record["ms"], "comm_ms": record["comm_ms"],
            "exposed_comm_ms": record["exposed_comm_ms"], "ops": lead.profile}


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
