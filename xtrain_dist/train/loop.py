"""train_rank: the training loop every rank runs, whatever the backend, communicator or world size."""

import contextlib
import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from ..backend import get_backend
from ..checkpoint import hf
from ..checkpoint.resume import restore, save
from ..comm.mesh import DeviceMesh
from ..comm.ring import RingAllReduce
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
from ..parallel.pipeline import run_schedule
from ..parallel.zero import make_stage
from ..profile import OpProfiler, mfu, nanogpt_flops_per_token
from . import metrics
from .cadence import Cadence
from .graph import StepGraph, unsupported
from .tensorboard import EventLog
from .wandb_log import WandbLog


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
    comm_bytes: dict = field(default_factory=dict)          # their payload bytes by group (comm/timed.py)
    comm_by_group: list[dict] = field(default_factory=list)  # each step's {group: [comm_s, exposed_s, peer_wait_s]}
    param_bytes: int = 0
    grad_bytes: int = 0
    zero_shards: list | None = None  # ZeRO-1: every rank's [lo, hi) of the flat buffer (a function of the layout)
    # ZeRO-2/3: the most bytes of blocks' gradient buffers and (ZeRO-3) of gathered parameters held at once
    zero_peak_bytes: dict | None = None
    profile: list | None = None      # --profile-step: OpProfiler.rows of that step
    # --cuda-graph: the mode, the steps run from the captured graph, and why none were where that is so
    cuda_graph: dict = field(default_factory=dict)


@dataclass
class QueuedStep:
    """A step the device has been given, whose values (loss, stop request, gradient norm) the host has not
    read yet."""
    done: int           # the step's number, counted from 1
    lr: float
    t0: float           # when the host started it
    profiling: bool     # --profile-step's step
    values: object      # backend.to_host_later(readout)
    comm_marks: list    # its collectives' clock marks (TimedCommunicator.detach)


def param_sha256(model) -> str:
    """Of the rank's flat parameters; at ZeRO-3, which keeps a shard, of the whole ones gathered (a collective)."""
    flat = model.ops.to_host(model.params) if model.params is not None else model.params_flat()
    return hashlib.sha256(np.ascontiguousarray(flat).tobytes()).hexdigest()


def micro_batches(ids: np.ndarray, targets: np.ndarray, k: int):
    """The rank's share of the global batch in k consecutive micro-batches, sizes differing by at most one.

    Any split is exact: every token's loss is scaled by 1/(BATCH*SEQ) however the batch is cut."""
    return list(zip(np.array_split(ids, k), np.array_split(targets, k), strict=True))


def micro_batch_rows(n_local: int, k: int, data_rank: int, data_world: int) -> list[tuple[int, int]]:
    """Where each of micro_batches' k micro-batches sits in the step's global batch, for dropout's masks:
    (seq0, seq_stride), row b of the micro-batch being global sequence seq0 + b * seq_stride. The rank holds
    sequences data_rank, data_rank + data_world, ... (BatchSampler), cut into k as np.array_split cuts them."""
    starts = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(n_local), k)])[:-1]
    return [(int(start) * data_world + data_rank, data_world) for start in starts]


# numpy would warn of each overflow in a step that diverges; the finite check in the loop ends such a run
# with one line instead
@np.errstate(over="ignore", invalid="ignore", divide="ignore")
def train_rank(rank: int, comm, cfg: TrainConfig, corpus: Corpus, device: int | None = None,
               log=print, resume=None, init=None, hellaswag=None, peak_flops=None, stop=None) -> RankResult:
    """One rank's whole run, from its first step (or the one after a checkpoint) to cfg.steps.

    Args:
        rank: this rank's place in the job (0 .. comm.world_size - 1); it picks the rank's sequences of
            every global batch (i % world == rank; with --tp or --pp, i % dp == the rank's data-parallel index).
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
    backend = get_backend(cfg.backend, device, allow_tf32=cfg.tf32, dtype=cfg.dtype, matmul=cfg.matmul,
                          attention=cfg.attention)
    # --profile-step N: the model and the optimizer call their ops through a profiler, which times each
    # op of step N on the backend's clock (profile.py) and passes every other call straight through
    ops = OpProfiler(backend, active=False) if cfg.profile_step else backend
    # --tp, --pp: the world as pp x dp x tp (comm/mesh.py); the gradient sync, the batch and evaluation are the
    # data-parallel group's, the model all-reduces over its tensor-parallel group and a pipeline stage sends its
    # activations and their gradients over its pipeline group. Without them every rank is one model.
    mesh = DeviceMesh(comm, dp=comm.world_size // cfg.tp // cfg.pp, tp=cfg.tp, pp=cfg.pp) \
        if cfg.tp > 1 or cfg.pp > 1 else None
    if mesh and cfg.grad_sync == "bucketed" and not getattr(comm, "concurrent_groups", True):
        option, what = (("--tp", "the tensor-parallel all-reduces") if cfg.tp > 1 else
                        ("--pp", "the pipeline's transfers"))
        raise XtrainError(f"{option} with --grad-sync bucketed calls MPI from two threads at once ({what} and the "
                          "overlapped gradient sync), and this MPI library was initialised without "
                          "MPI_THREAD_MULTIPLE: use --grad-sync flat")
    data_comm = mesh.dp if mesh else comm
    data_rank, data_world = data_comm.rank, data_comm.world_size
    # times the step's collectives on the backend's clock; evaluation and checkpoints use the communicators
    # themselves
    step_comm = TimedCommunicator(RingAllReduce(data_comm) if cfg.all_reduce == "ring" else data_comm, clock=backend)
    # the loss and the stop request go round the whole world, timed with the step's other collectives
    world_comm = step_comm.timing(comm, "world") if mesh else step_comm
    # this rank's pipeline group (stage = its rank there)
    pipe = step_comm.timing(mesh.pp, "pp") if mesh and cfg.pp > 1 else None
    tensor = step_comm.timing(mesh.tp, "tp") if mesh else None
    model = GPT2(model_config(cfg.model, corpus.vocab_size), ops, seed=cfg.seed, attention=cfg.attention,
                 recompute=cfg.recompute, tp=tensor, pp=pipe, dropout=cfg.dropout,
                 vocab_parallel=cfg.tp_classifier == "vocab", sequence_parallel=cfg.sequence_parallel)
    optimizer, grad_sync = make_stage(model, cfg, step_comm)
    if mesh and cfg.backend == "cuda" and hasattr(grad_sync, "settle"):
        # the overlapped sync's buckets are queued before the next tensor-parallel or pipeline collective and run
        # before it on the device: one order of collectives on every rank (docs/parallelism.md)
        for group in (tensor, pipe):
            if group is not None:
                group.before = grad_sync.settle
    sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=data_rank, world=data_world,
                           overfit=cfg.overfit_batch)
    powersgd = getattr(grad_sync, "powersgd", None)  # --grad-compress powersgd: its state is saved and restored
    start = restore(resume or cfg.resume, model, optimizer, sampler, powersgd, rank) if cfg.resume else 0
    if cfg.init_from:
        hf.load_pretrained(init or cfg.init_from, model)
    evaluator = (Evaluator(corpus.val, cfg.batch, cfg.seq, cfg.eval_batches, data_rank, data_world, backend)
                 if cfg.eval_batches else None)
    multiple_choice = None
    if cfg.hellaswag:
        examples = hellaswag or load_hellaswag(cfg, corpus)
        # about the positions of the rank's training micro-batch, whose activations fit
        tokens = max(1, cfg.batch // data_world // cfg.grad_accum) * cfg.seq
        multiple_choice = HellaSwag(examples, tokens, data_rank, data_world, backend)
    # --sample-every: rank 0 draws from a generator of its own (the batch sampler's is every rank's), so
    # sampling never changes what the run trains on; with --tp every rank of rank 0's tensor-parallel group
    # runs the same draws beside it (their forward passes all-reduce together, their logits are the same bits), and
    # with --pp every stage of rank 0's pipeline group (the logits are the last stage's, broadcast to the others)
    # (at ZeRO-3 every rank draws beside it: each forward gathers every rank's shard of the parameters)
    prompt = (prompt_ids(corpus.tokenizer, cfg.sample_prompt, cfg.tokenizer, "--sample-prompt")
              if cfg.sample_every and (data_rank == 0 or model.units.forward_is_collective) else None)
    # Each rank scales by the *global* token count, so the all-reduced sum of gradients is the
    # gradient of the global-batch mean loss, however the batch splits over ranks and micro-batches.
    dloss = 1.0 / (cfg.batch * cfg.seq)
    result = RankResult(rank, num_params=model.num_params, optimizer_state_bytes=optimizer.state_bytes,
                        start_step=start, param_bytes=model.param_bytes,
                        grad_bytes=model.grads.nbytes if model.grads is not None else optimizer.grad_bytes,
                        zero_shards=optimizer.shards,
                        step_flops=nanogpt_flops_per_token(model.config, cfg.seq) * cfg.batch * cfg.seq)
    cadence = Cadence(cfg, start)
    xp = backend.xp
    # What a step reads from the host lives in arrays kept for the whole run (a captured step, train/graph.py,
    # holds their addresses): the micro-batches, AdamW's schedule (optimizer.prepare) and `readout`, which
    # goes in as [0, stop asked, 0] and comes out as [the step's loss, ranks that asked to stop, the
    # squared gradient norm]. One all-reduce of its first two tells every rank both, so all of them stop
    # after the same step however the request reached them (one process's signal, or several).
    readout = xp.zeros(3, dtype=xp.float32)
    batch: list = []  # (ids, targets) on the device, per micro-batch
    # --dropout: each micro-batch's place in the global batch, which its masks are keyed by (None: no dropout)
    rows = (micro_batch_rows(sampler.n_local, cfg.grad_accum, data_rank, data_world) if cfg.dropout
            else [None] * cfg.grad_accum)
    tapes: dict = {}  # what each micro-batch's backward needs from its forward, while it is in flight

    def forward(i: int, inp):
        """Micro-batch i's forward on this rank (its pipeline stage's part, from `inp`, the activations the
        stage before sent): the losses on the last stage, else the activations for the next one."""
        ids, targets = batch[i]
        out, tapes[i] = model.stage_forward(ids, inp, targets, dloss, rows=rows[i])
        if model.is_last and model.tp_rank == 0:  # a tensor-parallel group's ranks have the same loss: count it once
            readout[:1] += out.sum(dtype=xp.float32) * np.float32(dloss)
        return out

    def backward(i: int, dout):
        """Micro-batch i's backward, accumulating into grads (from `dout`, the gradient the next stage sent):
        the gradient of the stage's input. The last micro-batch's (every schedule runs it last) starts the
        data-parallel communication."""
        every = getattr(grad_sync, "every_micro_batch", False)  # ZeRO-2/3 keep no whole gradient to accumulate in
        return model.stage_backward(tapes.pop(i), dout,
                                    grad_sync.on_grads_ready if every or i == len(batch) - 1 else None)

    def received(i: int):
        """Where micro-batch i's activations, or their gradient, from another stage land: (B_micro, T, C)."""
        return xp.empty(model.stream_shape(batch[i][0].shape), dtype=model.params_lowp.dtype)

    def device_step() -> None:
        """The step from inputs already on the device to updated parameters and `readout`: no host read,
        no host decision on a device value, so it can be captured and replayed."""
        model.zero_grad()
        if hasattr(grad_sync, "note_tokens"):  # the bucketed sync: the rows of wte the last backward writes (CPU)
            grad_sync.note_tokens(batch[-1][0])
        if pipe is None:  # gradient accumulation: each micro-batch's forward, then its backward
            for i in range(len(batch)):
                forward(i, None)
                backward(i, None)
        else:  # the schedule's order, with the transfers between stages (parallel/pipeline.py)
            run_schedule(pipe, cfg.pp_schedule, len(batch), forward, backward, received, received)
        grad_sync.finish()
        if pipe is not None and optimizer.sharded and model.tied_range:
            optimizer.gather_grads(*model.tied_range)  # ZeRO-1 reduced only the rank's shard of wte's gradient
        model.sum_tied_embedding_grads()  # the first and last stages' wte are one parameter
        world_comm.all_reduce(readout[:2])
        norm_squared = optimizer.grad_norm_squared()
        optimizer.update(ops.clip_coefficient(norm_squared, cfg.grad_clip))
        readout[2:] = norm_squared

    # --cuda-graph auto: device_step captured once and replayed (train/graph.py)
    result.cuda_graph = {"mode": cfg.cuda_graph, "replayed_steps": 0, "without": None}

    def without_graphs(why: str, show: bool) -> None:
        result.cuda_graph["without"] = why
        if show:
            log(f"--cuda-graph auto: rank {rank} runs without CUDA graphs: {why}")

    def capture_failed(why: str) -> None:
        grad_sync.reset()  # the step stopped part way; it runs again without the graph
        step_comm.detach()  # marks recorded in the abandoned capture: never timed on the device
        without_graphs(why, True)

    step_graph = None
    if cfg.cuda_graph == "auto":
        why_not = "the numpy backend queues nothing to capture" if cfg.backend != "cuda" else unsupported(cfg, comm)
        if why_not is None:
            step_graph = StepGraph(device_step, backend.stream, on_failure=capture_failed)
        else:
            without_graphs(why_not, rank == 0 and cfg.backend == "cuda")

    def complete(queued: QueuedStep, can_stop_here: bool, stop_forced: bool = False,
                 next_t0: float | None = None) -> tuple[bool, bool]:
        """Read a queued step's values (waiting for the GPU to get there), and do what the step's end does:
        its record, the divergence check, evaluation, sample, log line, metrics line, checkpoints. Returns
        (a rank asked to stop, the run ends after this step). A stop request read here ends the run here
        when nothing was queued after this step (`can_stop_here`); otherwise the caller ends it after the
        step it queued, which every rank queued too (`stop_forced` when it completes that one), whose start
        is `next_t0`."""
        loss_host, stops, norm_sq_host = queued.values.result()
        # The host runs a step ahead, so a step's time is from its start to the next step's start, which in a
        # steady run is the time the device and the host take per step; a step nothing was queued after (one
        # read at once, the last) ends at its read. Either way the step's own evaluation, sample and save,
        # which come after its read, are not in it.
        ms = ((time.perf_counter() if next_t0 is None else next_t0) - queued.t0) * 1e3
        if queued.profiling:
            result.profile, ops.active = OpProfiler.rows(ops.report()), False
        done = queued.done
        stopping = cadence.stops(done, stop_forced or (can_stop_here and stops > 0))
        record = {"step": done, "loss": float(loss_host), "lr": queued.lr, "grad_norm": float(np.sqrt(norm_sq_host)),
                  "ms": ms, "tokens_per_s": cfg.batch * cfg.seq / ms * 1e3}
        if queued.comm_marks is not None:
            # a step run from a graph has no timing marks of its own: its collectives' times are not known
            by_group = step_comm.tally_groups(queued.comm_marks)
            comm_s, exposed_s = step_comm.totals(by_group)
            result.comm_calls = step_comm.calls(queued.comm_marks)
            result.comm_bytes = step_comm.payload(queued.comm_marks)
            result.comm_by_group.append(by_group)
            record.update(comm_ms=comm_s * 1e3, exposed_comm_ms=exposed_s * 1e3)
            if step_comm.knows_peers:
                record["peer_wait_ms"] = step_comm.peer_wait(by_group) * 1e3
        if peak_flops:
            record["mfu"] = mfu(result.step_flops, ms, peak_flops)
        if not (np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])):
            # both are all-reduced, so every rank stops at this step together; a step that saves is read
            # before anything is queued after it, so no save can put parameters that are no longer numbers
            # over a good checkpoint
            if rank == 0:
                log(metrics.progress_line(record, cfg.steps))
            raise XtrainError(f"step {done}: training diverged (loss {record['loss']}, gradient norm "
                              f"{record['grad_norm']}): the parameters are no longer finite, so the run "
                              "stops here and saves nothing; lower --lr")
        if cadence.evaluates(done):
            if evaluator:
                record["val_loss"] = evaluator.loss(model, data_comm)
            if multiple_choice:
                record["hellaswag"] = multiple_choice.accuracy(model, data_comm)
        if prompt is not None and cadence.samples(done):
            record["sample"] = continuation(model, corpus.tokenizer, prompt, cfg.sample_tokens, seed=cfg.seed,
                                            show_prompt=bool(cfg.sample_prompt))
        result.records.append(record)
        times = progress.times(done, ms / 1e3)
        if rank == 0 and cadence.logs(done, stopping):
            log(metrics.progress_line(record, cfg.steps, times))
        if rank == 0 and "sample" in record:
            log(f"--- sample at step {done} ---\n{record['sample']}\n---")
        if rank == 0 and cfg.metrics and (note := metrics.append(cfg.metrics, record)):  # a note: a torn line dropped
            log(note)
        if events is not None:
            events.write(record)
        if wandb_run is not None:
            wandb_run.write(record)
        for folder in cadence.saves(done, stopping):
            save(folder, rank=rank, comm=comm, step=done, cfg=cfg, corpus=corpus,
                 model=model, optimizer=optimizer, sampler=sampler, powersgd=powersgd)
            if rank == 0:
                log(f"saved checkpoint '{folder}' at step {done}")
        if stopping:
            result.stopped_at = done
        return stops > 0, stopping

    progress = metrics.Progress(cfg.steps)
    events = EventLog(cfg.tensorboard) if rank == 0 and cfg.tensorboard else None
    wandb_run = WandbLog(cfg.wandb, cfg.options) if rank == 0 and cfg.wandb is not None else None
    try:
        behind = None  # a step queued but not yet read: read once the next one is queued
        for step in range(start, cfg.steps):
            done = step + 1
            profiling = cadence.profiles(done)
            if profiling:
                ops.active = True
            t0 = time.perf_counter()
            micro = micro_batches(*sampler.next(), cfg.grad_accum)
            if not batch:
                batch[:] = [(backend.from_host(np.array(ids)), backend.from_host(np.array(targets)))
                            for ids, targets in micro]
            else:
                for (d_ids, d_targets), (ids, targets) in zip(batch, micro, strict=True):
                    backend.upload(d_ids, ids)
                    backend.upload(d_targets, targets)
            backend.upload(readout, np.array([0, stop is not None and stop.is_set(), 0], dtype=np.float32))
            if cfg.dropout:
                model.set_dropout_step(done)  # the masks' step: a number in memory, read by a replayed graph too
            lr = lr_at(step, cfg)
            optimizer.prepare(lr)
            if step_graph is not None and not profiling:  # a profiled step times each op: outside the graph
                capturing = step_graph.graph is None and step_graph.warm and not step_graph.failed
                replayed = step_graph()
                marks = step_comm.detach()
                if replayed:  # a launch of the graph leaves no timing marks of its own
                    if capturing:  # the capture's marks count its collectives, but were never timed on the device
                        result.comm_calls = step_comm.calls(marks)
                        result.comm_bytes = step_comm.payload(marks)
                    marks = None
                result.cuda_graph["replayed_steps"] += replayed
            else:
                device_step()
                marks = step_comm.detach()
            queued = QueuedStep(done, lr, t0, profiling, backend.to_host_later(readout), marks)
            if behind is not None:
                asked, _ = complete(behind, can_stop_here=False, next_t0=t0)
                behind = None
                if asked:  # every rank read the request at the same step, and every rank queued this one
                    complete(queued, can_stop_here=True, stop_forced=True)
                    break
            if cadence.reads_at_once(done):
                if complete(queued, can_stop_here=True)[1]:
                    break
            else:
                behind = queued
    except BaseException:
        # the run fails for its own reason: a write error of a side writer's closing is not it
        for writer in (events, wandb_run):
            if writer is not None:
                with contextlib.suppress(XtrainError):
                    writer.close()
        raise
    for writer in (events, wandb_run):
        if writer is not None:
            writer.close()

    result.param_sha256 = param_sha256(model)
    if cfg.zero >= 2:
        # the gathered parameters and gradient buffers alive when their sum was largest (parallel/zero.py)
        gathered, grad_buffers = optimizer.peak_transient
        result.zero_peak_bytes = {"grad_buffers": grad_buffers, "gathered_params": gathered}
    return result
