"""The data-parallel step written out by hand, as the oracle of whole training runs.

One GPT2 on the numpy backend plays every rank in turn: each rank's sequences of the global batch
(BatchSampler, i % world == rank), forward and backward in its micro-batches, then the sync done here
with no communicator, no buckets and no shards: each rank's gradient rounded to bfloat16 (with
compression), the ranks summed in float32 in rank order, the sum rounded again, then clipping and AdamW.
It rounds exactly where a run rounds, so a run of train() must give its losses, gradient norms and
parameters to the bit; a sync that drops a rank, sums a micro-batch twice, rounds in another place or
scales by the world size does not.

Shared by tests/test_ddp.py, tests/test_zero.py and tests/test_train.py.
"""

import hashlib

import numpy as np

from xtrain_dist.backend import numpy_ops
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.sampler import BatchSampler
from xtrain_dist.model import GPT2
from xtrain_dist.optim import AdamW, lr_at


def bf16(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    numpy_ops.bf16_round(x)
    return x


def hand_synced_run(corpus, cfg: TrainConfig) -> dict:
    """cfg's run (numpy backend, no ZeRO: ZeRO-1 must not change a bit where clipping is off) as
    {"losses", "grad_norms", "param_sha256"}, each as train()'s report gives it."""
    world, compress = cfg.world_size, cfg.grad_compress == "bf16"
    model = GPT2(model_config(cfg.model, corpus.vocab_size), numpy_ops, seed=cfg.seed)
    optimizer = AdamW(model, cfg)
    samplers = [BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=r, world=world)
                for r in range(world)]
    dloss = 1.0 / (cfg.batch * cfg.seq)  # every token's loss over the global token count
    losses, norms = [], []
    for step in range(cfg.steps):
        rank_grads, rank_losses = [], []
        for sampler in samplers:
            ids, targets = sampler.next()
            model.zero_grad()
            loss = np.float32(0)
            # micro-batches accumulate into grads; the sum leaves the rank after the last of them
            for micro_ids, micro_targets in zip(np.array_split(ids, cfg.grad_accum),
                                                np.array_split(targets, cfg.grad_accum), strict=True):
                loss = loss + model.forward(micro_ids, micro_targets, dloss).sum(dtype=np.float32) * np.float32(dloss)
                model.backward()
            rank_grads.append(bf16(model.grads) if compress else model.grads.copy())
            rank_losses.append(loss)
        total, loss = rank_grads[0], rank_losses[0]
        for grads, rank_loss in zip(rank_grads[1:], rank_losses[1:], strict=True):
            total, loss = total + grads, loss + rank_loss
        model.grads[:] = bf16(total) if compress else total
        optimizer.prepare(lr_at(step, cfg))
        norm_squared = optimizer.grad_norm_squared()
        optimizer.update(numpy_ops.clip_coefficient(norm_squared, cfg.grad_clip))
        losses.append(float(loss))
        norms.append(float(np.sqrt(norm_squared[0])))
    return {"losses": losses, "grad_norms": norms,
            "param_sha256": hashlib.sha256(np.ascontiguousarray(model.params).tobytes()).hexdigest()}
