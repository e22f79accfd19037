"""ZeRO-1: the optimizer state is split over the ranks, 1/world each, and training does not notice."""

from itertools import pairwise

import numpy as np
import pytest
from ddp_oracle import hand_synced_run

from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.model import ALIGN
from xtrain_dist.parallel.zero import shard_bounds
from xtrain_dist.train.job import train

TINY_SIZE = 370432  # elements of the tiny model's flat buffer: 11576 x ALIGN, not a multiple of 3 x ALIGN


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, world, steps=5, **kw):
    cfg = TrainConfig(steps=steps, batch=8, seq=32, model="tiny", seed=7, world_size=world, **kw).resolved()
    return train(cfg, corpus, log=lambda line: None)


def max_rel_diff(a, b) -> float:
    a, b = np.array(a), np.array(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_shards_partition_the_buffer_on_aligned_cuts(world):
    shards = shard_bounds(TINY_SIZE, world)
    assert shards[0][0] == 0 and shards[-1][1] == TINY_SIZE
    assert all(a[1] == b[0] for a, b in pairwise(shards))
    assert all(lo % ALIGN == 0 for lo, _ in shards)
    sizes = [hi - lo for lo, hi in shards]
    assert max(sizes) - min(sizes) <= ALIGN
    if world == 3:
        assert sizes == [123456, 123488, 123488]  # uneven, and not padded


def test_more_ranks_than_aligned_groups_leaves_some_shards_empty():
    assert shard_bounds(2 * ALIGN, 3) == [(0, 0), (0, ALIGN), (ALIGN, 2 * ALIGN)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero1_follows_the_unsharded_run_with_1_over_world_of_the_state(corpus, world):
    plain = run(corpus, world)
    sharded = run(corpus, world, zero=1)
    assert sharded["zero"] == 1 and plain["zero_shards"] is None
    assert len(set(sharded["param_sha256"])) == 1
    assert max_rel_diff(sharded["losses"], plain["losses"]) < 1e-5
    # optimizer state: m and v for the own shard only
    full = plain["optimizer_state_bytes"][0]
    assert full == 2 * 4 * TINY_SIZE and set(plain["optimizer_state_bytes"]) == {full}
    per_rank = sharded["optimizer_state_bytes"]
    assert sum(per_rank) == full
    assert all(abs(b - full / world) <= 2 * 4 * ALIGN for b in per_rank)
    assert [[lo, hi] for lo, hi in shard_bounds(TINY_SIZE, world)] == sharded["zero_shards"]
    # parameters and gradients stay whole on every rank (that is ZeRO-2 and -3)
    assert sharded["param_bytes"] == sharded["grad_bytes"] == [4 * TINY_SIZE] * world


@pytest.mark.parametrize("grad_sync", ["per-param", "flat", "bucketed"])
def test_without_clipping_zero1_is_bitwise_the_unsharded_run(corpus, grad_sync):
    """Reduce-scatter sums in the same rank order as all-reduce and AdamW is elementwise, so only the
    global norm's summation order can differ; with clipping off the runs are identical."""
    kw = {"grad_sync": grad_sync, "bucket_mb": 0.05, "grad_clip": 0.0}
    plain = run(corpus, 3, **kw)
    sharded = run(corpus, 3, zero=1, **kw)
    assert sharded["losses"] == plain["losses"]
    assert sharded["param_sha256"] == plain["param_sha256"]


def test_zero1_with_bf16_and_accumulation_is_the_hand_synced_step(corpus):
    """ZeRO-1, bf16 compression and two micro-batches at once against tests/ddp_oracle.py, which rounds
    where the run rounds: losses, gradient norms and parameters to the bit (clipping off, so the sharded
    norm's summation order does not reach the parameters; the clipped run follows the unsharded one above)."""
    cfg = TrainConfig(steps=5, batch=8, seq=32, model="tiny", seed=7, world_size=3, zero=1, grad_compress="bf16",
                      grad_accum=2, bucket_mb=0.05, grad_clip=0.0).resolved()
    combined = train(cfg, corpus, log=lambda line: None)
    oracle = hand_synced_run(corpus, cfg)
    assert combined["losses"] == oracle["losses"]
    assert combined["grad_norms"] == oracle["grad_norms"]
    assert combined["param_sha256"] == [oracle["param_sha256"]] * 3
