"""Pipeline schedules (parallel/pipeline.py): GPipe and 1F1B run every micro-batch's forward before its
backward, keep what each promises in memory, idle the bubble (p - 1) / (m + p - 1) when timed event by
event, never deadlock when every transfer blocks until its peer's matching half is posted, and, run on
thread ranks over a chain of layers, give the gradients of the same chain run on one rank bit for bit."""

import itertools

import numpy as np
import pytest

from xtrain_dist.parallel.pipeline import (
    SCHEDULES,
    bubble_fraction,
    peak_in_flight,
    run_schedule,
    schedule,
    schedule_peak_in_flight,
    simulate,
    transfers,
)
from xtrain_dist.train.launch import run_thread_ranks

GRID = list(itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 8)))  # (stages, micro-batches)


def test_1f1b_is_warmup_steady_cooldown():
    assert schedule("1f1b", 4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                         ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert schedule("1f1b", 4, 6, 3) == [a for i in range(6) for a in (("F", i), ("B", i))]
    assert schedule("gpipe", 2, 2, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match=r"^a pipeline schedule is one of gpipe, 1f1b, got 'zb'$"):
        schedule("zb", 2, 2, 0)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, micro", GRID)
def test_every_micro_batch_runs_forward_then_backward_once_and_memory_is_what_each_schedule_keeps(kind, stages,
                                                                                               micro):
    for stage in range(stages):
        actions = schedule(kind, stages, micro, stage)
        assert sorted(actions) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(micro))
        assert [i for a, i in actions if a == "B"] == list(range(micro))  # gradients accumulate in one order
        assert peak_in_flight(actions) == (micro if kind == "gpipe" else min(stages - stage, micro))
        # the closed form the memory check uses (a schedule of --grad-accum 1e9 is not listed) against the listing
        assert schedule_peak_in_flight(kind, stages, micro, stage) == peak_in_flight(actions)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, micro", GRID)
def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1(kind, stages, micro):
    """Timed event by event with F = 1 and B = 2: the step lasts (m + p - 1)(F + B), and each stage idles
    the formula's share of it, in both schedules."""
    duration, idle = simulate(kind, stages, micro, forward_cost=1.0, backward_cost=2.0)
    assert duration == (micro + stages - 1) * 3.0
    assert all(abs(i / duration - bubble_fraction(stages, micro)) < 1e-12 for i in idle)


def rendezvous(programs) -> None:
    """Run every stage's program with blocking transfers: a transfer is done once each of its halves has met
    the opposite half, for the same micro-batch's tensor, posted by its peer's current transfer. Raises where
    no stage can move."""
    position = [0] * len(programs)
    matched = [set() for _ in programs]  # the halves of each stage's current transfer already met

    def current(s):
        while position[s] < len(programs[s]) and programs[s][position[s]][0] == "run":
            position[s] += 1
        return programs[s][position[s]][1] if position[s] < len(programs[s]) else None

    while any(current(s) is not None for s in range(len(programs))):
        moved = False
        for s in range(len(programs)):
            mine = current(s)
            if mine is None:
                continue
            theirs = current(mine.peer)
            if theirs is None or theirs.peer != s:
                continue
            for half, tensor, opposite in (("send", mine.send, theirs.recv), ("recv", mine.recv, theirs.send)):
                if tensor is not None and half not in matched[s] and tensor == opposite:
                    matched[s].add(half)
                    matched[mine.peer].add("recv" if half == "send" else "send")
                    moved = True
            for t in (s, mine.peer):
                transfer = current(t)
                if transfer is not None and {h for h, x in (("send", transfer.send), ("recv", transfer.recv))
                                             if x is not None} <= matched[t]:
                    position[t] += 1
                    matched[t] = set()
                    moved = True
        if not moved:
            raise RuntimeError(f"deadlock at {[current(s) for s in range(len(programs))]}")


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, micro", GRID)
def test_blocking_transfers_never_deadlock(kind, stages, micro):
    programs = [transfers(schedule(kind, stages, micro, s), stages, s) for s in range(stages)]
    rendezvous(programs)
    if stages > 1 and micro > 1 and kind == "1f1b":  # the steady state's sends ride with the next receive
        assert any(t.send is not None and t.recv is not None for p in programs for step, t in p
                   if step == "transfer")


def test_unfused_transfers_would_deadlock():
    """The checker can fail: 1F1B with each send and receive on its own blocks forever (stage 0 sends its
    second activation while stage 1 sends its first gradient)."""
    programs = []
    for s in range(2):
        program = []
        for step, t in transfers(schedule("1f1b", 2, 3, s), 2, s):
            if step == "transfer" and t.send is not None and t.recv is not None:
                program += [("transfer", type(t)(t.peer, send=t.send)), ("transfer", type(t)(t.peer, recv=t.recv))]
            else:
                program.append((step, t))
        programs.append(program)
    with pytest.raises(RuntimeError, match=r"^deadlock"):
        rendezvous(programs)


def chain(stages, width=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(stages)]


def reference_grads(weights, inputs):
    """The whole chain on one rank: y = tanh(x W) per layer, loss = 0.5 sum(y^2) per micro-batch, summed."""
    grads = [np.zeros_like(w) for w in weights]
    for x in inputs:
        acts = [x]
        for w in weights:
            acts.append(np.tanh(acts[-1] @ w))
        d = acts[-1]
        for layer in reversed(range(len(weights))):
            d = d * (1 - acts[layer + 1] ** 2)
            grads[layer] += acts[layer].T @ d
            d = d @ weights[layer].T
    return grads


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, micro", [(2, 4), (3, 2), (4, 5)])
def test_a_chain_split_over_thread_ranks_gets_one_ranks_gradients_bitwise(kind, stages, micro):
    weights = chain(stages)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(micro)]
    want = reference_grads(weights, inputs)

    def body(rank, comm):
        w, grad = weights[rank], np.zeros_like(weights[rank])
        saved = {}

        def forward(i, inp):
            x = inputs[i] if rank == 0 else inp
            y = np.tanh(x @ w)
            saved[i] = (x, y)
            return y

        def backward(i, dout):
            x, y = saved.pop(i)
            d = (y if rank == stages - 1 else dout) * (1 - y ** 2)
            grad[...] += x.T @ d
            return d @ w.T

        buffer = lambda i: np.empty((3, 8), np.float32)  # noqa: E731
        run_schedule(comm, kind, micro, forward, backward, buffer, buffer)
        assert not saved  # every micro-batch's activations were freed by its backward
        return grad

    got = run_thread_ranks(stages, body, timeout_s=30)
    for stage in range(stages):
        assert np.array_equal(got[stage], want[stage]), stage
