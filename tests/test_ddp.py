"""Gradient synchronisation: per-param, flat and bucketed give the same bits; buckets really overlap
backward; bf16 compression does what it says; gradient accumulation equals the big batch."""

import os
import threading
import time
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest
from ddp_oracle import hand_synced_run

from xtrain_dist.backend import numpy_ops
from xtrain_dist.comm.local import LocalGroup
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.layout import ALIGN
from xtrain_dist.model import GPT2
from xtrain_dist.parallel import ddp, zero
from xtrain_dist.train.cli import main
from xtrain_dist.train.job import train
from xtrain_dist.train.launch import RankFailed, run_thread_ranks

SMALL_BUCKET_MB = 0.05  # cuts the tiny model (1.4 MiB of gradients) into 29 buckets
# ... of which the bucketed sync reduces the 22 that reach into what backward's end makes final (the first block's
# ln_1 and the embeddings) as one piece (ddp.join_the_tail), less the part of the first of them before ln_1 (the
# attention's products): 7 + 1 + 1; with more than one rank that tail goes in two parts, after the row sets' all-reduce
# (the embeddings' rows no token reads early, the rest after backward: ddp.EmbeddingRows)
TINY_PIECES = 8 + 3


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, world, steps=5, batch=8, seq=32, **kw):
    cfg = TrainConfig(steps=steps, batch=batch, seq=seq, model="tiny", seed=7, world_size=world, **kw).resolved()
    return train(cfg, corpus, log=lambda line: None)


def max_rel_diff(a, b) -> float:
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.fixture(scope="module")
def flat_runs(corpus):
    """The reference of each world size: one all-reduce of the whole buffer."""
    return {world: run(corpus, world, grad_sync="flat") for world in (1, 2, 3, 4)}


# ---------------------------------------------------------------- against PyTorch's DDP
# Each world's cases train in one PyTorch launch (torch_gpt2.ddp_runs): its processes import torch once.
PEER_CASES = {2: {"even": (4, {}),
                  "bf16": (4, {"grad_compress": "bf16"})},  # against ddp_comm_hooks.default_hooks.bf16_compress_hook
              3: {"uneven": (4, {}),                        # ranks of 2, 1 and 1 sequences
                  "zero1": (6, {"zero": 1})}}               # against torch.distributed.optim.ZeroRedundancyOptimizer


@pytest.mark.parametrize("world", sorted(PEER_CASES))
@pytest.mark.long
def test_ranks_train_as_pytorch_ddp_does(corpus, tmp_path, world):
    """An independent implementation of the whole data-parallel step: PyTorch's own DDP (gloo, one process
    per rank, xtrain_dist.bench.torch_gpt2.ddp_runs) from the same weights on the same global batches, each
    rank averaging its local mean loss's gradients (scaled by its share of the batch where the shares are
    uneven) where ours sums gradients of 1/(BATCH*SEQ)-scaled losses; ZeRO-1 against PyTorch's
    ZeroRedundancyOptimizer, bf16 compression against PyTorch's bf16 hook.

    The bounds. In float32 the two differ by rounding only: each gradient element by about 5e-7 of itself
    (measured per parameter at step 1), so the norms (both summed in float64) by as little (1.5e-7
    measured), the losses by 1.3e-7 and the parameters by 6e-5 after six steps, where one AdamW step moves
    them by about lr = 1e-2. A gradient off by the world size shows in the norms (clipping would hide it
    from the losses), a rank that steps on its own gradient or a wrong shard in the parameters.
    PyTorch's hook rounds g / world to bf16 and sums in bf16, ours rounds g and sums in float32 then rounds:
    at world 2 the halving is exact and the sum of two bf16 numbers is exact in float32, so both give
    bf16(bf16(g0) + bf16(g1)) except where the two float32 gradients straddle a bf16 rounding boundary: one
    bf16 ulp (2^-8) of that element, a rare element, so the norms move by 2.1e-6 (measured) and the
    parameters by at most about 2^-8 of an AdamW step per step, 6 x 1e-2 x 2^-8 = 2.3e-4 over six steps
    (measured 2.2e-4). Hence 1e-5 on losses and norms, 5e-4 on parameters; compression missing on either
    side moves the losses by 4.7e-5, the norms by 5e-5 to 1.2e-3 and the parameters by 3e-2, and the sum
    left unrounded the norms by 1.2e-4."""
    pytest.importorskip("torch")
    from xtrain_dist.bench import torch_gpt2
    from xtrain_dist.checkpoint import store

    cfgs = {case: TrainConfig(steps=6, batch=batch, seq=16, model="tiny", seed=1, world_size=world, lr=1e-2,
                              save_dir=str(tmp_path / case), **options).resolved()
            for case, (batch, options) in PEER_CASES[world].items()}
    peers = torch_gpt2.ddp_runs(list(cfgs.values()), world=world, threads=1, sdpa=False)
    for (case, cfg), theirs in zip(cfgs.items(), peers, strict=True):
        ours = train(cfg, corpus, log=lambda line: None)
        assert theirs["ranks_equal"] and len(set(ours["param_sha256"])) == 1, case
        assert max_rel_diff(ours["losses"], theirs["losses"]) < 1e-5, case
        assert max_rel_diff(ours["grad_norms"], theirs["grad_norms"]) < 1e-5, case
        params = store.open_checkpoint(tmp_path / case).model_state(model_config("tiny", corpus.vocab_size))
        assert params.keys() == theirs["params"].keys(), case
        assert max(np.max(np.abs(params[k] - theirs["params"][k])) for k in params) < 5e-4, case


@pytest.mark.long
def test_a_pytorch_ddp_peer_that_fails_is_one_line(tmp_path):
    pytest.importorskip("torch")
    from xtrain_dist.bench import torch_gpt2

    cfg = TrainConfig(steps=1, batch=2, seq=16, tokenizer=str(DEFAULT_TOKENIZER),
                      corpus=str(tmp_path / "gone.txt")).resolved()
    with pytest.raises(XtrainError, match=r"^the PyTorch DDP peer failed in rank [01]: xtrain_dist.errors.XtrainError: "
                                          r"corpus '.*gone.txt' not found$"):
        torch_gpt2.ddp_run(cfg, world=2)


# ---------------------------------------------------------------- buckets

def test_buckets_tile_the_buffer_in_aligned_slices():
    size = 370432
    buckets = ddp.bucket_bounds(size, SMALL_BUCKET_MB)
    assert buckets[0][0] == 0 and buckets[-1][1] == size
    assert all(a[1] == b[0] for a, b in pairwise(buckets))
    assert {hi - lo for lo, hi in buckets[:-1]} == {13120}  # 0.05 MiB = 13107.2 floats, rounded to 410 x ALIGN
    assert len(buckets) == 29
    assert ddp.bucket_bounds(size, 25) == [(0, size)]
    assert ddp.bucket_bounds(size, 1e-9)[0] == (0, ALIGN)  # never empty


def test_the_buckets_that_backward_ends_together_go_as_one_piece():
    """The buckets past the start of backward's last two announcements (the first block's ln_1, the embeddings)
    become final together when backward ends: the bucketed sync reduces them as one piece, and cuts the bucket
    that reaches into them there, so that its part before (the first block's attention products, final one
    product earlier) goes on its own; the buckets before are cut by size as ever."""
    assert ddp.join_the_tail([(0, 10), (10, 20), (20, 25)], 15) == [(0, 10), (10, 15), (15, 25)]
    assert ddp.join_the_tail([(0, 10), (10, 20), (20, 25)], 20) == [(0, 10), (10, 20), (20, 25)]
    assert ddp.join_the_tail([(0, 10), (10, 20)], 0) == [(0, 20)]
    assert ddp.join_the_tail([(0, 10), (10, 20)], 3) == [(0, 3), (3, 20)]
    model = GPT2(model_config("tiny", 512), numpy_ops, seed=1)
    cfg = TrainConfig(steps=1, batch=1, seq=16, grad_sync="bucketed", bucket_mb=SMALL_BUCKET_MB)
    grad_sync = ddp.make_grad_sync(cfg, LocalGroup(1).communicator(0), model)
    *_, (_, ln_1), (_, embeddings), _ = model.grad_ready_ranges()
    assert [s.name for s in model.layout if ln_1 <= s.offset < embeddings] == [
        "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"]
    by_size = ddp.bucket_bounds(model.size, SMALL_BUCKET_MB)
    head = [b for b in by_size if b[1] <= ln_1]
    assert head[-1][1] < ln_1 < by_size[len(head)][1]  # a bucket reaches from the attention's products into ln_1
    assert grad_sync.pieces == [*head, (head[-1][1], ln_1), (ln_1, model.size)]
    assert len(by_size) - len(head) >= 3  # wte's 32768 floats and wpe's 8192: three buckets and more, joined
    grad_sync.close()


# ---------------------------------------------------------------- the three strategies

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_strategies_give_the_same_bits(corpus, flat_runs, world):
    """Every strategy sums each element over the ranks in rank order, so the pieces do not change a bit."""
    flat = flat_runs[world]
    assert len(set(flat["param_sha256"])) == 1
    for kw in ({"grad_sync": "per-param"}, {"grad_sync": "bucketed", "bucket_mb": SMALL_BUCKET_MB}):
        other = run(corpus, world, **kw)
        assert other["losses"] == flat["losses"], kw
        assert other["param_sha256"] == flat["param_sha256"], kw
    assert max_rel_diff(flat["losses"], flat_runs[1]["losses"]) < 1e-5  # and every world follows world 1


def test_collectives_per_step(corpus, flat_runs):
    """The loss all-reduce, plus: one call (flat), one per parameter (per-param), one per bucket, those that
    backward's end makes final (the 22 of the 29 that reach into the first block's ln_1, wpe and wte) as one, less
    the part of the first before ln_1; that tail goes as the row sets, the rows no token reads and the rest."""
    n_params = len(GPT2(model_config("tiny", corpus.vocab_size), numpy_ops).layout)
    assert flat_runs[2]["comm_calls_per_step"] == 1 + 1
    assert run(corpus, 2, steps=2, grad_sync="per-param")["comm_calls_per_step"] == n_params + 1
    bucketed = run(corpus, 2, steps=2, grad_sync="bucketed", bucket_mb=SMALL_BUCKET_MB)
    assert bucketed["comm_calls_per_step"] == TINY_PIECES + 1 == (29 - 22 + 1) + 3 + 1
    for key in ("grad_sync", "zero", "grad_accum", "comm_s", "exposed_comm_s"):
        assert key in bucketed
    assert bucketed["grad_sync"] == "bucketed" and bucketed["zero"] == 0 and bucketed["grad_accum"] == 1
    assert bucketed["comm_s"] > 0 and bucketed["exposed_comm_s"] > 0
    # without a mesh every collective is the data-parallel group's: its share by group is the whole
    assert bucketed["comm_s_by_group"] == {"dp": {"comm_s": pytest.approx(bucketed["comm_s"]),
                                                  "exposed_s": pytest.approx(bucketed["exposed_comm_s"])}}


def test_the_default_is_bucketed():
    cfg = TrainConfig(steps=1, batch=1, seq=1)
    assert (cfg.grad_sync, cfg.bucket_mb, cfg.grad_compress, cfg.zero, cfg.grad_accum) == ("bucketed", 25.0, "none",
                                                                                           0, 1)


# ---------------------------------------------------------------- overlap

class RecordingComm:
    """A communicator that logs when each all-reduce starts and on which thread."""

    def __init__(self, comm, events, lock, started):
        self.comm, self.events, self.lock, self.started = comm, events, lock, started
        self.rank, self.world_size = comm.rank, comm.world_size

    def all_reduce(self, buf):
        with self.lock:
            self.events.append(("reduce", buf.size, threading.current_thread().name))
        self.started.set()
        self.comm.all_reduce(buf)


def rank_ids(rank: int):
    """record_one_step's tokens on a rank: 16 of a vocabulary of 64."""
    return np.random.default_rng(rank).integers(0, 64, (1, 16)).astype(np.int32)


def record_one_step(grad_sync_name, world=2, hold_s=10.0, note_tokens=False):
    """Each rank: forward, then backward whose first announcement holds backward until an all-reduce
    has started (or hold_s has passed). Returns every rank's event log. note_tokens: the sync is told the
    step's tokens, as the training loop tells it."""
    config = model_config("tiny", 64)
    cfg = TrainConfig(steps=1, batch=world, seq=16, world_size=world, grad_sync=grad_sync_name,
                      bucket_mb=SMALL_BUCKET_MB)

    def body(rank, comm):
        events, lock, started = [], threading.Lock(), threading.Event()
        model = GPT2(config, numpy_ops, seed=1)
        grad_sync = ddp.make_grad_sync(cfg, RecordingComm(comm, events, lock, started), model)
        ids = rank_ids(rank)
        model.forward(ids, np.roll(ids, -1, axis=1), 1.0 / 16)
        if note_tokens:
            grad_sync.note_tokens(ids)

        def on_grads_ready(start, end):
            with lock:
                events.append(("ready", end, threading.current_thread().name))
            grad_sync.on_grads_ready(start, end)
            if start == 0:  # the first announcement: ln_f and the last block are final, two blocks to go
                started.wait(hold_s)

        model.backward(on_grads_ready)
        with lock:
            events.append(("backward done", model.size, threading.current_thread().name))
        grad_sync.finish()
        return events, model.size

    return run_thread_ranks(world, body)


def test_bucketed_reduces_while_backward_still_runs():
    for events, size in record_one_step("bucketed"):
        kinds = [e[0] for e in events]
        first_reduce, done = kinds.index("reduce"), kinds.index("backward done")
        assert first_reduce < kinds.index("ready", 1) < done  # before block 0's gradients were even computed
        rank_thread = events[0][2]
        reducers = [e[2] for e in events if e[0] == "reduce"]
        # the communication thread reduces all but the tail, which the rank's thread reduces after backward
        # (EmbeddingRows: the communication thread is idle by then, a hand-over would cost two wake-ups)
        assert set(reducers[:-1]) == {f"{rank_thread}-comm"} and reducers[-1] == rank_thread
        assert kinds.index("backward done") < len(kinds) - 1 - kinds[::-1].index("reduce")
        assert sum(e[1] for e in events if e[0] == "reduce") == size  # every bucket exactly once
        # a bucket starts only once the announced prefix covers it
        covered, bucket_end = 0, 0
        for kind, n, _ in events:
            if kind == "ready":
                covered = n
            elif kind == "reduce":
                bucket_end += n
                assert bucket_end <= covered


def test_the_embeddings_rows_no_token_reads_go_before_block_0_and_the_rest_after_backward():
    """With the step's tokens, the first reduces at backward's first announcement are the row sets (a count for
    each of wpe's 128 rows and wte's 128, the vocabulary of 64 padded) and the rows that neither rank's tokens
    read, gathered (C elements each): wpe's past the 16 positions, wte's of no token. The last, after backward,
    is the rest of what backward's end makes final: the first block's ln_1, the rows some token reads and the
    padding. Every element once."""
    config = model_config("tiny", 64)
    rows, positions, C, T = config.padded_vocab_size, config.n_ctx, config.n_embd, 16
    read = len(np.union1d(rank_ids(0), rank_ids(1)))
    assert 0 < read < 64 < rows
    model = GPT2(config, numpy_ops, seed=1)
    ln_1 = model.grad_ready_ranges()[-2][0]
    (wpe_lo, wpe_hi), (wte_lo, wte_hi) = [(s.offset, s.offset + s.size) for s in model.layout[-2:]]
    padding = (wpe_lo - ln_1 - 2 * C) + (wte_lo - wpe_hi) + (model.size - wte_hi)
    for events, size in record_one_step("bucketed", note_tokens=True):
        reduces = [(i, n) for i, (kind, n, _) in enumerate(events) if kind == "reduce"]
        ready = [i for i, (kind, _, _) in enumerate(events) if kind == "ready"]
        done = next(i for i, (kind, _, _) in enumerate(events) if kind == "backward done")
        assert [n for _, n in reduces[:2]] == [positions + rows, (positions - T + rows - read) * C]
        assert ready[0] < reduces[0][0] < ready[1]  # handed over at the first announcement (which holds for it)
        assert reduces[-1][1] == 2 * C + (T + read) * C + padding and reduces[-1][0] > done
        assert sum(n for _, n in reduces) == size + positions + rows


def test_the_early_rows_keep_the_flat_syncs_bits_with_accumulation_and_bf16(corpus):
    """The rows of wte that the last micro-batch's tokens do not read go early, also where an earlier micro-batch
    read them (their part is in by then); bf16's roundings of a gathered copy are those of the piece in place."""
    for kw in ({"grad_accum": 2}, {"grad_compress": "bf16"}):
        flat = run(corpus, 2, steps=3, grad_sync="flat", **kw)
        bucketed = run(corpus, 2, steps=3, grad_sync="bucketed", bucket_mb=SMALL_BUCKET_MB, **kw)
        assert bucketed["param_sha256"] == flat["param_sha256"], kw
        assert bucketed["comm_calls_per_step"] == TINY_PIECES + 1


def scheduling_of_the_communication_thread(run_on_it) -> tuple[int, int]:
    """(policy, priority) that a job run on a communication thread finds itself at."""
    seen = []
    run_on_it(lambda: seen.append((os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)))
    return seen[0]


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="no POSIX scheduling calls here")
@pytest.mark.parametrize("asked", ddp.PRIORITIES)
def test_the_communication_threads_run_at_the_priority_asked(asked):
    """realtime: SCHED_FIFO at the lowest real-time priority, for the bucketed sync's thread and ZeRO-2/3's; normal:
    the ordinary policy; auto: realtime exactly where the OS grants it (the check refuses realtime where it does
    not: the next test)."""
    if asked == "realtime" and not ddp.realtime_granted():
        pytest.skip("the OS grants this process no real-time priority")
    expected = "realtime" if asked == "realtime" or (asked == "auto" and ddp.realtime_granted()) else "normal"
    assert ddp.comm_priority(asked) == expected
    policy = (os.SCHED_FIFO, os.sched_get_priority_min(os.SCHED_FIFO)) if expected == "realtime" else (
        os.SCHED_OTHER, 0)
    model = GPT2(model_config("tiny", 64), numpy_ops, seed=1)
    cfg = TrainConfig(steps=1, batch=1, seq=16, grad_sync="bucketed", comm_priority=asked)
    grad_sync = ddp.make_grad_sync(cfg, LocalGroup(1).communicator(0), model)

    def on_bucketed_thread(job):
        grad_sync._work.put((job, None))
        grad_sync._work.join()

    zero_thread = zero._CommThread(numpy_ops, "test-zero", ddp.comm_priority(asked))
    assert scheduling_of_the_communication_thread(on_bucketed_thread) == policy
    assert scheduling_of_the_communication_thread(lambda job: zero_thread.wait(zero_thread.submit(job))) == policy
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the rank's own thread keeps its own
    grad_sync.close()
    zero_thread.close()


def test_realtime_priority_where_the_os_refuses_it_is_refused(monkeypatch):
    """No quiet fallback: --comm-priority realtime where the OS grants none ends the run before it starts; auto then
    means normal."""
    monkeypatch.setattr(ddp, "realtime_granted", lambda: False)
    cfg = TrainConfig(steps=1, batch=2, seq=16, world_size=2, comm_priority="realtime")
    with pytest.raises(XtrainError) as info:
        ddp.check_config(cfg)
    assert str(info.value) == (
        "--comm-priority realtime: the OS refuses this process a real-time priority (Linux grants it to root, to "
        "CAP_SYS_NICE, or up to `ulimit -r`); --comm-priority auto or normal runs the communication threads at normal "
        "priority")
    assert ddp.comm_priority("auto") == "normal"
    with pytest.raises(XtrainError) as info:
        ddp.check_config(TrainConfig(steps=1, batch=2, seq=16, comm_priority="high"))
    assert str(info.value) == "--comm-priority must be one of auto, realtime, normal, got 'high'"


def test_the_report_says_which_priority_the_communication_threads_had(corpus):
    report = run(corpus, 2, steps=2, grad_sync="bucketed", bucket_mb=SMALL_BUCKET_MB)
    assert report["comm_priority"] == ddp.comm_priority("auto")
    assert run(corpus, 2, steps=2, grad_sync="flat")["comm_priority"] is None  # no communication thread


def test_flat_waits_for_backward():
    """The harness's negative control: without overlap no reduction starts before backward is done."""
    for events, _ in record_one_step("flat", hold_s=0.2):
        kinds = [e[0] for e in events]
        assert kinds.index("backward done") < kinds.index("reduce")


def test_a_failure_in_the_communication_thread_ends_the_run(corpus, monkeypatch):
    real = ddp.PieceReducer.__call__
    calls = {"n": 0}

    def failing(self, lo, hi):
        if self.comm.rank == 1 and threading.current_thread().name.endswith("-comm"):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected bucket failure")
        return real(self, lo, hi)

    monkeypatch.setattr(ddp.PieceReducer, "__call__", failing)
    with pytest.raises(RankFailed) as info:
        run(corpus, 3, steps=2, bucket_mb=SMALL_BUCKET_MB, comm_timeout_s=30)
    assert info.value.rank == 1 and str(info.value.error) == "injected bucket failure"


def test_gradients_announced_out_of_layout_order_are_refused():
    """A bucket is handed over once the announced prefix covers it; an announcement that overlaps or skips
    part of that prefix would hand over a bucket whose gradients are not final."""
    model = GPT2(model_config("tiny", 64), numpy_ops, seed=1)
    cfg = TrainConfig(steps=1, batch=1, seq=16, grad_sync="bucketed", bucket_mb=SMALL_BUCKET_MB)
    grad_sync = ddp.make_grad_sync(cfg, LocalGroup(1).communicator(0), model)
    grad_sync.on_grads_ready(0, 64)
    for start, end in ((0, 128), (32, 128), (128, 192)):  # overlapping, overlapping, a gap
        with pytest.raises(RuntimeError) as info:
            grad_sync.on_grads_ready(start, end)
        assert str(info.value) == f"gradients announced out of layout order: [{start}, {end}) after [0, 64)"
    grad_sync.on_grads_ready(64, model.size)  # the next piece is taken
    grad_sync.finish()
    grad_sync.close()


@pytest.mark.parametrize("announced", [(), ((0, 200),), ((0, 200), (200, 1000))])
def test_finish_reduces_what_backward_did_not_announce(announced):
    """finish() hands over every bucket not handed over yet, also when backward announced part or none of the
    buffer: two steps, each the rank-order sum of every element."""
    n, world = 1000, 2
    cfg = TrainConfig(steps=1, batch=world, seq=1, world_size=world, grad_sync="bucketed",
                      bucket_mb=96 * 4 / ddp.MIB)  # 11 buckets of 96 elements, the last one of 40

    def grads(step, rank):
        return np.random.default_rng([step, rank]).standard_normal(n).astype(np.float32)

    def body(rank, comm):
        model = SimpleNamespace(size=n, grads=np.empty(n, np.float32), ops=numpy_ops)
        grad_sync = ddp.make_grad_sync(cfg, comm, model)
        sums = []
        for step in range(2):
            model.grads[...] = grads(step, rank)
            for start, end in announced:
                grad_sync.on_grads_ready(start, end)
            grad_sync.finish()
            sums.append(model.grads.copy())
        grad_sync.close()
        return sums

    for sums in run_thread_ranks(world, body):
        for step, reduced in enumerate(sums):
            assert reduced.tobytes() == (grads(step, 0) + grads(step, 1)).tobytes()


@pytest.mark.parametrize("sync, announced", [("flat", False), ("bucketed", False), ("bucketed", True)])
def test_the_wait_for_a_slower_rank_is_told_apart_from_communication(sync, announced):
    """Rank 1 ends its backward 0.3 s after rank 0: rank 0's sync waits that long for it, which is in its exposed
    time (its thread stood still) and, all of it, in its peer wait (no communication was left to do until then).
    Rank 1 waits for no one: its peer wait is 0. The 3 steps' marks are 3 keys, each read in its own step.
    announced: backward announces the whole buffer before finish(), as the model does, so the last pieces go
    before finish(); the mark is then taken at that announcement (from the second step, once the sync knows the
    ranks share a clock), and rank 1 lingers 0.3 s between it and finish(), which must not count."""
    n, world, late_s = 100_000, 2, 0.3
    cfg = TrainConfig(steps=1, batch=world, seq=1, world_size=world, grad_sync=sync, bucket_mb=0.1)

    def body(rank, comm):
        model = SimpleNamespace(size=n, grads=np.ones(n, np.float32), ops=numpy_ops)
        grad_sync = ddp.make_grad_sync(cfg, comm, model)
        timed = grad_sync.reduce_piece.comm
        waits = []
        for _ in range(3):
            if rank == 1:
                time.sleep(late_s)
            if announced:
                grad_sync.on_grads_ready(0, n)
                if rank == 1:
                    time.sleep(late_s)  # after its last announcement: rank 0 waits on nothing of this
            grad_sync.finish()
            groups = timed.tally_groups(timed.detach())
            waits.append((*timed.totals(groups), timed.peer_wait(groups), timed.knows_peers))
        grad_sync.close()
        return waits

    first, second = run_thread_ranks(world, body)
    for step, ((_, exposed, peers, knows), (_, _, peers_1, _)) in enumerate(zip(first, second, strict=True)):
        assert knows and peers_1 == 0.0
        if announced and step == 0:  # the mark at finish(): rank 1's is 0.3 s late, rank 0's end caps the wait
            assert peers <= exposed
        else:
            assert late_s * 0.8 < peers <= exposed < peers + 0.2


def test_report_means_leave_out_the_warm_up_step():
    cfg = TrainConfig(steps=3, batch=2, seq=4, world_size=2, grad_sync="flat")

    def rank_result(*comm_s):  # step records whose collectives took comm_s, all of it exposed
        return SimpleNamespace(records=[{"comm_ms": s * 1e3, "exposed_comm_ms": s * 1e3} for s in comm_s],
                               comm_by_group=[{"dp": [s, s]} for s in comm_s],
                               comm_calls=2, comm_bytes={"dp": 64}, zero_shards=None)

    fields = ddp.report_fields(cfg, [rank_result(8.0, 1.0, 2.0), rank_result(8.0, 3.0, 2.0)])
    assert fields["comm_s"] == 2.0  # (1 + 2 + 3 + 2) / 4: the first step of each rank left out
    assert fields["comm_s_by_group"] == {"dp": {"comm_s": 2.0, "exposed_s": 2.0}}  # by group alike
    one_step = ddp.report_fields(cfg, [rank_result(8.0), rank_result(4.0)])
    assert one_step["exposed_comm_s"] == 6.0  # one step only: then that step counts
    assert fields["comm_calls_per_step"] == 2 and fields["zero_shards"] is None
    assert fields["comm_bytes_per_step"] == {"dp": 64}  # rank 0's


# ---------------------------------------------------------------- bf16 compression

@pytest.mark.parametrize("world", [2, 3])
def test_bf16_reduction_is_the_rounded_sum_of_rounded_gradients(world):
    n = 1000

    def grads(rank):
        return np.random.default_rng([3, rank]).standard_normal(n).astype(np.float32) * np.float32(1e-3)

    def body(rank, comm):
        buf = grads(rank)
        ddp.PieceReducer(comm, buf, numpy_ops, compress="bf16")(0, n)
        return buf

    def bf16(x):
        x = x.copy()
        numpy_ops.bf16_round(x)
        return x

    expected = bf16(grads(0))
    for r in range(1, world):
        expected = expected + bf16(grads(r))  # float32 sums in rank order, no division by the world size
    expected = bf16(expected)
    for buf in run_thread_ranks(world, body):
        assert buf.tobytes() == expected.tobytes()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bf16_training_is_the_hand_synced_step(corpus, flat_runs, world):
    """Against tests/ddp_oracle.py, which rounds each rank's gradient and the sum where the run does:
    losses, gradient norms and parameters to the bit, so a rank left out of the sum or a rounding moved
    shows at once (a loss tolerance cannot hold them: AdamW's first step is the gradient's sign, which
    rounding keeps, and a 1e-2 bound let a sum of rank 0's gradient alone through)."""
    report = run(corpus, world, grad_sync="flat", grad_compress="bf16")
    assert report["grad_compress"] == "bf16"
    assert report["param_sha256"] != flat_runs[world]["param_sha256"]  # it did round something
    cfg = TrainConfig(steps=5, batch=8, seq=32, model="tiny", seed=7, world_size=world, grad_compress="bf16")
    oracle = hand_synced_run(corpus, cfg.resolved())
    assert report["losses"] == oracle["losses"]
    assert report["grad_norms"] == oracle["grad_norms"]
    assert report["param_sha256"] == [oracle["param_sha256"]] * world


# ---------------------------------------------------------------- gradient accumulation

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_accumulation_equals_the_whole_batch(corpus, flat_runs, world):
    """BATCH 8 as K=2 micro-batches per rank equals BATCH 8 in one; bucketed, so that a bucket sent
    before the last micro-batch would show as a wrong sum."""
    accumulated = run(corpus, world, grad_accum=2, grad_sync="bucketed", bucket_mb=SMALL_BUCKET_MB)
    assert accumulated["grad_accum"] == 2
    assert max_rel_diff(accumulated["losses"], flat_runs[world]["losses"]) < 1e-5
    # AdamW (and clipping) hide a gradient scaled by a constant, K or 1/world, from the losses: the norms do not
    assert max_rel_diff(accumulated["grad_norms"], flat_runs[world]["grad_norms"]) < 1e-5
    assert len(set(accumulated["param_sha256"])) == 1
    pieces = TINY_PIECES if world > 1 else TINY_PIECES - 2  # one rank: the tail whole (no sum to start early)
    assert accumulated["comm_calls_per_step"] == pieces + 1  # nothing more than without accumulation


def test_accumulation_with_uneven_micro_batches(corpus):
    """BATCH 7 on 2 ranks with K=3: rank 0 trains 4 sequences as 2+1+1, rank 1 three as 1+1+1."""
    one = run(corpus, 1, batch=7, grad_sync="flat")
    accumulated = run(corpus, 2, batch=7, grad_accum=3)
    assert max_rel_diff(accumulated["losses"], one["losses"]) < 1e-5
    assert max_rel_diff(accumulated["grad_norms"], one["grad_norms"]) < 1e-5
    assert len(set(accumulated["param_sha256"])) == 1


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, message", [
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0, got '0'"),
    (["--bucket-mb", "inf"], "--bucket-mb must be a finite number > 0, got 'inf'"),  # no bucket size to round
    (["--bucket-mb", "x"], "--bucket-mb must be a finite number > 0, got 'x'"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer, got '0'"),
    (["--grad-accum", "1.5"], "--grad-accum must be a positive integer, got '1.5'"),
    (["--world-size", "2", "--grad-accum", "3"],
     "BATCH (4) must be at least the world size times --grad-accum (2 x 3 = 6): every micro-batch needs a "
     "sequence on every rank"),
    (["--zero", "4"], "--zero must be one of 0, 1, 2, 3, got '4'"),
    (["--grad-compress", "fp8"], "--grad-compress must be one of none, bf16, powersgd, got 'fp8'"),
])
def test_bad_options_get_one_line(capsys, args, message):
    assert main(["2", "4", "16", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"train_ddp: error: {message}")  # argparse quotes by version


@pytest.mark.parametrize("options, message", [
    (dict(bucket_mb=0.0), "--bucket-mb must be a positive number, got 0"),
    (dict(bucket_mb=float("nan")), "--bucket-mb must be a positive number, got nan"),
    (dict(grad_accum=0), "--grad-accum must be at least 1, got 0"),
    (dict(zero=4), "--zero must be 0, 1, 2 or 3, got 4"),
    (dict(grad_sync="ring"), "--grad-sync must be one of per-param, flat, bucketed, got 'ring'"),
])
def test_a_config_built_in_code_is_checked_as_the_command_line_is(options, message):
    """train() is called with a TrainConfig by tests and scripts, past argparse's types: the same checks
    hold there."""
    cfg = TrainConfig(steps=1, batch=4, seq=16, world_size=1, **options)
    with pytest.raises(XtrainError) as raised:
        ddp.check_config(cfg)
    assert str(raised.value).startswith(message)


def test_settle_returns_once_every_bucket_handed_over_is_reduced_and_none_after():
    """The overlapped sync's order beside --tp/--pp (BucketedGradSync.settle): when settle returns, the
    communication thread has issued every bucket backward handed over (on the CPU issued is done), however slow
    its communicator, and none of the buckets not yet handed over; settle before any hand-over issues nothing."""
    n = 3 * 96
    cfg = TrainConfig(steps=1, batch=1, seq=1, world_size=1, grad_sync="bucketed", bucket_mb=96 * 4 / ddp.MIB)
    issued = []

    class Slow:
        rank, world_size = 0, 1

        def all_reduce(self, buf):
            threading.Event().wait(0.05)  # a slow wire: without settle's wait, the list below would be short
            issued.append(buf.size)

    model = SimpleNamespace(size=n, grads=np.zeros(n, np.float32), ops=numpy_ops)
    grad_sync = ddp.make_grad_sync(cfg, Slow(), model)
    grad_sync.settle()
    assert issued == []
    grad_sync.on_grads_ready(0, 2 * 96)
    grad_sync.settle()
    assert issued == [96, 96]
    grad_sync.finish()
    assert issued == [96, 96, 96]
    grad_sync.close()
