"""train_rank: the training loop every rank runs, whatever the backend, communicator or world size."""

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from .backend import get_backend
from .comm.timed import TimedCommunicator
from .config import TrainConfig, model_config
from .data import BatchSampler, Corpus
from .ddp import make_grad_sync
from .model import GPT2
from .optim import lr_at, make_optimizer


@dataclass
class RankResult:
    rank: int
    losses: list[float] = field(default_factory=list)       # global-batch mean loss of every step
    grad_norms: list[float] = field(default_factory=list)   # before clipping
    lrs: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    param_sha256: str = ""                                  # of the flat parameter buffer after the last step
    num_params: int = 0
    optimizer_state_bytes: int = 0
    # communication (ddp.py): seconds per step in collectives, and the part the rank's thread waited for
    comm_s: list[float] = field(default_factory=list)
    exposed_comm_s: list[float] = field(default_factory=list)
    comm_calls: int = 0                                     # collectives in the last step
    param_bytes: int = 0
    grad_bytes: int = 0
    zero_shard: tuple[int, int] | None = None               # ZeRO-1: [lo, hi) of the flat buffer this rank owns


def param_sha256(model) -> str:
    return hashlib.sha256(np.ascontiguousarray(model.ops.to_host(model.params)).tobytes()).hexdigest()


def micro_batches(ids: np.ndarray, targets: np.ndarray, k: int):
    """The rank's share of the global batch in k consecutive micro-batches, sizes differing by at most one.

    Any split is exact: every token's loss is scaled by 1/(BATCH*SEQ) however the batch is cut."""
    return list(zip(np.array_split(ids, k), np.array_split(targets, k), strict=True))


def train_rank(rank: int, comm, cfg: TrainConfig, corpus: Corpus, device: int | None = None,
               log=print) -> RankResult:
    backend = get_backend(cfg.backend, device)
    comm = TimedCommunicator(comm)
    model = GPT2(model_config(cfg.model, corpus.vocab_size), backend, seed=cfg.seed)
    optimizer = make_optimizer(model, cfg, comm)
    grad_sync = make_grad_sync(cfg, comm, model, shards=optimizer.shards)
    sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=rank, world=comm.world_size)
    # Each rank scales by the *global* token count, so the all-reduced sum of gradients is the
    # gradient of the global-batch mean loss, however the batch splits over ranks and micro-batches.
    dloss = 1.0 / (cfg.batch * cfg.seq)
    result = RankResult(rank, num_params=model.num_params, optimizer_state_bytes=optimizer.state_bytes,
                        param_bytes=model.params.nbytes, grad_bytes=model.grads.nbytes,
                        zero_shard=optimizer.shards[rank] if optimizer.shards else None)

    for step in range(cfg.steps):
        t0 = time.perf_counter()
        model.zero_grad()
        loss = backend.xp.zeros(1, dtype=backend.xp.float32)
        micro = micro_batches(*sampler.next(), cfg.grad_accum)
        for i, (ids, targets) in enumerate(micro):
            losses = model.forward(backend.from_host(ids), backend.from_host(targets), dloss)
            loss += losses.sum(dtype=backend.xp.float32) * np.float32(dloss)
            # backward accumulates into grads; only the last micro-batch's starts the communication
            model.backward(on_grads_ready=grad_sync.on_grads_ready if i == len(micro) - 1 else None)
        grad_sync.finish()
        comm.all_reduce(loss)
        norm_squared = optimizer.grad_norm_squared()
        lr = lr_at(step, cfg)
        optimizer.step(lr, backend.clip_coefficient(norm_squared, cfg.grad_clip))
        loss_host, norm_sq_host = backend.to_host(backend.xp.concatenate([loss, norm_squared]))  # the step's one read
        ms = (time.perf_counter() - t0) * 1e3
        comm_s, exposed_s, result.comm_calls = comm.take()

        result.losses.append(float(loss_host))
        result.grad_norms.append(float(np.sqrt(norm_sq_host)))
        result.lrs.append(lr)
        result.step_ms.append(ms)
        result.comm_s.append(comm_s)
        result.exposed_comm_s.append(exposed_s)
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            log(f"step {step + 1:5d}/{cfg.steps} | loss {loss_host:.4f} | lr {lr:.2e} | "
                f"norm {result.grad_norms[-1]:7.4f} | {ms:7.1f} ms | {cfg.batch * cfg.seq / ms * 1e3:9.0f} tok/s")

    result.param_sha256 = param_sha256(model)
    return result
