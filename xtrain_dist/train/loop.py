"""train_rank: the training loop every rank runs, whatever the backend, communicator or world size."""

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from ..backend import get_backend
from ..checkpoint import hf
from ..checkpoint.resume import restore, save
from ..comm.timed import TimedCommunicator
from ..config import TrainConfig, model_config
from ..data.corpus import Corpus
from ..data.sampler import BatchSampler
from ..errors import XtrainError
from ..eval.evaluate import Evaluator
from ..eval.hellaswag import HellaSwag
from ..eval.hellaswag import load as load_hellaswag
from ..eval.sample import continuation, prompt_ids
from ..model import GPT2
from ..optim import lr_at
from ..parallel.ddp import make_grad_sync
from ..parallel.zero import make_optimizer
from ..profile import OpProfiler, mfu, nanogpt_flops_per_token
from . import metrics
from .cadence import Cadence


@dataclass
class RankResult:
    rank: int
    # every step's metrics record (train/metrics.py: loss, lr, grad_norm, ms, comm_ms, exposed_comm_ms, and val_loss,
    # hellaswag, sample where the step had them), in step order: the report derives its lists from them
    records: list[dict] = field(default_factory=list)
    start_step: int = 0                                     # steps done before this run (resumed from a checkpoint)
    stopped_at: int = 0                                     # the step a stop request ended the run after (0: none)
    param_sha256: str = ""                                  # of the flat parameter buffer after the last step
    num_params: int = 0
    step_flops: float = 0.0                                 # model flops of one step, all ranks (MFU's numerator)
    optimizer_state_bytes: int = 0
    comm_calls: int = 0                                     # collectives in the last step (parallel/ddp.py)
    param_bytes: int = 0
    grad_bytes: int = 0
    zero_shards: list | None = None  # ZeRO-1: every rank's [lo, hi) of the flat buffer (a function of the layout)
    profile: list | None = None      # --profile-step: OpProfiler.rows of that step


def param_sha256(model) -> str:
    return hashlib.sha256(np.ascontiguousarray(model.ops.to_host(model.params)).tobytes()).hexdigest()


def micro_batches(ids: np.ndarray, targets: np.ndarray, k: int):
    """The rank's share of the global batch in k consecutive micro-batches, sizes differing by at most one.

    Any split is exact: every token's loss is scaled by 1/(BATCH*SEQ) however the batch is cut."""
    return list(zip(np.array_split(ids, k), np.array_split(targets, k), strict=True))


# numpy would warn of each overflow in a step that diverges; the finite check in the loop ends such a run
# with one line instead
@np.errstate(over="ignore", invalid="ignore", divide="ignore")
def train_rank(rank: int, comm, cfg: TrainConfig, corpus: Corpus, device: int | None = None,
               log=print, resume=None, init=None, hellaswag=None, peak_flops=None, stop=None) -> RankResult:
    """One rank's whole run, from its first step (or the one after a checkpoint) to cfg.steps.

    Args:
        rank: this rank's place in the job (0 .. comm.world_size - 1); it picks the rank's sequences of
            every global batch (i % world == rank).
        comm: the rank's communicator (comm/): the gradient sync, the loss and the stop request use it.
        cfg: the run's configuration; corpus: its loaded token ids and tokenizer.
        device: the GPU the rank binds (cuda); None on the CPU.
        log: where rank 0 writes its progress lines.
        resume: what to restore from, a checkpoint.resume.shared_restore that the process's ranks share;
            by default cfg.resume is read.
        init: the pretrained weights to start from, a checkpoint.store.Shared of them; by default
            cfg.init_from's are read.
        hellaswag: the examples of cfg.hellaswag; by default read from it.
        peak_flops: the dense peak FLOP/s of all the job's GPUs together, where known
            (job.job_peak_flops): each step's record then has its MFU.
        stop: a threading.Event that, once set on any rank of the job (job.StopRequest, on SIGTERM or
            SIGUSR1), ends the run after the step every rank is in, with a checkpoint in cfg.save_dir.
    """
    backend = get_backend(cfg.backend, device, allow_tf32=cfg.tf32, dtype=cfg.dtype, matmul=cfg.matmul)
    # --profile-step N: the model and the optimizer call their ops through a profiler, which times each
    # op of step N on the backend's clock (profile.py) and passes every other call straight through
    ops = OpProfiler(backend, active=False) if cfg.profile_step else backend
    model = GPT2(model_config(cfg.model, corpus.vocab_size), ops, seed=cfg.seed, attention=cfg.attention,
                 recompute=cfg.recompute)
    # times the step's collectives on the backend's clock; evaluation and checkpoints use comm itself
    step_comm = TimedCommunicator(comm, clock=backend)
    optimizer = make_optimizer(model, cfg, step_comm)
    grad_sync = make_grad_sync(cfg, step_comm, model, shards=optimizer.shards)
    sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=rank, world=comm.world_size,
                           overfit=cfg.overfit_batch)
    start = restore(resume or cfg.resume, model, optimizer, sampler) if cfg.resume else 0
    if cfg.init_from:
        hf.load_pretrained(init or cfg.init_from, model)
    evaluator = (Evaluator(corpus.val, cfg.batch, cfg.seq, cfg.eval_batches, rank, comm.world_size, backend)
                 if cfg.eval_batches else None)
    multiple_choice = None
    if cfg.hellaswag:
        examples = hellaswag or load_hellaswag(cfg, corpus)
        # about the positions of the rank's training micro-batch, whose activations fit
        tokens = max(1, cfg.batch // comm.world_size // cfg.grad_accum) * cfg.seq
        multiple_choice = HellaSwag(examples, tokens, rank, comm.world_size, backend)
    # --sample-every: rank 0 draws from a generator of its own (the batch sampler's is every rank's), so
    # sampling never changes what the run trains on
    prompt = (prompt_ids(corpus.tokenizer, cfg.sample_prompt, cfg.tokenizer, "--sample-prompt")
              if cfg.sample_every and rank == 0 else None)
    # Each rank scales by the *global* token count, so the all-reduced sum of gradients is the
    # gradient of the global-batch mean loss, however the batch splits over ranks and micro-batches.
    dloss = 1.0 / (cfg.batch * cfg.seq)
    result = RankResult(rank, num_params=model.num_params, optimizer_state_bytes=optimizer.state_bytes,
                        start_step=start, param_bytes=model.param_bytes, grad_bytes=model.grads.nbytes,
                        zero_shards=optimizer.shards,
                        step_flops=nanogpt_flops_per_token(model.config, cfg.seq) * cfg.batch * cfg.seq)
    cadence = Cadence(cfg, start)

    for step in range(start, cfg.steps):
        profiling = cadence.profiles(step + 1)
        if profiling:
            ops.active = True
        t0 = time.perf_counter()
        model.zero_grad()
        # [the step's loss, the ranks asked to stop]: one all-reduce tells every rank both, so all of them
        # stop after the same step however the request reached them (one process's signal, or several)
        loss = backend.xp.zeros(2, dtype=backend.xp.float32)
        micro = micro_batches(*sampler.next(), cfg.grad_accum)
        for i, (ids, targets) in enumerate(micro):
            losses = model.forward(backend.from_host(ids), backend.from_host(targets), dloss)
            loss[:1] += losses.sum(dtype=backend.xp.float32) * np.float32(dloss)
            # backward accumulates into grads; only the last micro-batch's starts the communication
            model.backward(on_grads_ready=grad_sync.on_grads_ready if i == len(micro) - 1 else None)
        grad_sync.finish()
        if stop is not None and stop.is_set():
            loss[1] = 1
        step_comm.all_reduce(loss)
        norm_squared = optimizer.grad_norm_squared()
        lr = lr_at(step, cfg)
        optimizer.step(lr, ops.clip_coefficient(norm_squared, cfg.grad_clip))
        loss_host, stops, norm_sq_host = backend.to_host(backend.xp.concatenate([loss, norm_squared]))  # the one read
        ms = (time.perf_counter() - t0) * 1e3
        if profiling:
            result.profile, ops.active = OpProfiler.rows(ops.report()), False
        comm_s, exposed_s, result.comm_calls = step_comm.take()
        done = step + 1
        stopping = cadence.stops(done, stops > 0)
        record = {"step": done, "loss": float(loss_host), "lr": lr, "grad_norm": float(np.sqrt(norm_sq_host)),
                  "ms": ms, "tokens_per_s": cfg.batch * cfg.seq / ms * 1e3,
                  "comm_ms": comm_s * 1e3, "exposed_comm_ms": exposed_s * 1e3}
        if peak_flops:
            record["mfu"] = mfu(result.step_flops, ms, peak_flops)
        if not (np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])):
            # both are all-reduced, so every rank stops at this step together, before a save could put
            # parameters that are no longer numbers over a good checkpoint
            if rank == 0:
                log(metrics.progress_line(record, cfg.steps))
            raise XtrainError(f"step {done}: training diverged (loss {record['loss']}, gradient norm "
                              f"{record['grad_norm']}): the parameters are no longer finite, so the run "
                              "stops here and saves nothing; lower --lr")
        if cadence.evaluates(done):
            if evaluator:
                record["val_loss"] = evaluator.loss(model, comm)
            if multiple_choice:
                record["hellaswag"] = multiple_choice.accuracy(model, comm)
        if prompt is not None and cadence.samples(done):
            record["sample"] = continuation(model, corpus.tokenizer, prompt, cfg.sample_tokens, seed=cfg.seed,
                                            show_prompt=bool(cfg.sample_prompt))
        result.records.append(record)
        if rank == 0 and cadence.logs(done, stopping):
            log(metrics.progress_line(record, cfg.steps))
        if "sample" in record:
            log(f"--- sample at step {done} ---\n{record['sample']}\n---")
        if rank == 0 and cfg.metrics:
            metrics.append(cfg.metrics, record)
        for folder in cadence.saves(done, stopping):
            save(folder, rank=rank, comm=comm, step=done, cfg=cfg, corpus=corpus,
                 model=model, optimizer=optimizer, sampler=sampler)
            if rank == 0:
                log(f"saved checkpoint '{folder}' at step {done}")
        if stopping:
            result.stopped_at = done
            break

    result.param_sha256 = param_sha256(model)
    return result
