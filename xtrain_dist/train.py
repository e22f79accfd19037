"""train_rank: the training loop every rank runs, whatever the backend, communicator or world size."""

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from .backend import get_backend
from .config import TrainConfig, model_config
from .data import BatchSampler, Corpus
from .ddp import make_grad_sync
from .model import GPT2
from .optim import AdamW, lr_at


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


def param_sha256(model) -> str:
    return hashlib.sha256(np.ascontiguousarray(model.ops.to_host(model.params)).tobytes()).hexdigest()


def train_rank(rank: int, comm, cfg: TrainConfig, corpus: Corpus, device: int | None = None,
               log=print) -> RankResult:
    backend = get_backend(cfg.backend, device, allow_tf32=cfg.tf32)
    model = GPT2(model_config(cfg.model, corpus.vocab_size), backend, seed=cfg.seed)
    optimizer = AdamW(model, cfg)
    grad_sync = make_grad_sync(cfg.grad_sync, comm, model)
    sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=rank, world=comm.world_size)
    # Each rank scales by the *global* token count, so the all-reduced sum of gradients is the
    # gradient of the global-batch mean loss, however the batch splits over ranks.
    dloss = 1.0 / (cfg.batch * cfg.seq)
    result = RankResult(rank, num_params=model.num_params, optimizer_state_bytes=optimizer.state_bytes)

    for step in range(cfg.steps):
        t0 = time.perf_counter()
        ids, targets = (backend.from_host(a) for a in sampler.next())
        model.zero_grad()
        losses = model.forward(ids, targets, dloss)
        model.backward(on_grads_ready=grad_sync.on_grads_ready)
        grad_sync.finish()
        loss = (losses.sum(dtype=backend.xp.float32) * np.float32(dloss)).reshape(1)
        comm.all_reduce(loss)
        norm_squared = backend.global_norm_squared(model.grads)
        lr = lr_at(step, cfg)
        optimizer.step(lr, backend.clip_coefficient(norm_squared, cfg.grad_clip))
        loss_host, norm_sq_host = backend.to_host(backend.xp.concatenate([loss, norm_squared]))  # the step's one read
        ms = (time.perf_counter() - t0) * 1e3

        result.losses.append(float(loss_host))
        result.grad_norms.append(float(np.sqrt(norm_sq_host)))
        result.lrs.append(lr)
        result.step_ms.append(ms)
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            log(f"step {step + 1:5d}/{cfg.steps} | loss {loss_host:.4f} | lr {lr:.2e} | "
                f"norm {result.grad_norms[-1]:7.4f} | {ms:7.1f} ms | {cfg.batch * cfg.seq / ms * 1e3:9.0f} tok/s")

    result.param_sha256 = param_sha256(model)
    return result
