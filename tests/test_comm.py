"""The in-process communicator and the thread launcher: correct sums, identical bits on every rank,
and collective failure (a dying or stuck rank ends the run instead of hanging it)."""

import threading
import time
from itertools import pairwise

import numpy as np
import pytest

from xtrain_dist.comm import CommAborted, local, shard_offsets
from xtrain_dist.comm.local import LocalGroup, _chunk
from xtrain_dist.launch import RankFailed, run_thread_ranks


def rank_data(rank, n, seed=0):
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_all_reduce_is_the_rank_ordered_sum_on_every_rank(world, n):
    def body(rank, comm):
        buf = rank_data(rank, n)
        comm.all_reduce(buf)
        return buf

    out = run_thread_ranks(world, body)
    expected = rank_data(0, n)
    for r in range(1, world):
        expected = expected + rank_data(r, n)  # the fixed order: ((r0 + r1) + r2) + ...
    for buf in out:
        assert buf.tobytes() == expected.tobytes()


def ordered_sum(arrays):
    total = arrays[0].copy()
    for a in arrays[1:]:
        total = total + a  # the fixed order: ((r0 + r1) + r2) + ...
    return total


@pytest.mark.parametrize("world", [2, 3])
def test_sums_that_span_many_blocks_keep_the_order_and_the_bits(world, monkeypatch):
    monkeypatch.setattr(local, "BLOCK", 7)  # 1000 elements: many blocks per chunk, a ragged last one
    n = 1000

    def body(rank, comm):
        buf = rank_data(rank, n, seed=1) * np.float32(10.0 ** rank)  # magnitudes that make order matter
        comm.all_reduce(buf)
        return buf

    expected = ordered_sum([rank_data(r, n, seed=1) * np.float32(10.0 ** r) for r in range(world)])
    for buf in run_thread_ranks(world, body):
        assert buf.tobytes() == expected.tobytes()


def test_chunks_partition_any_length():
    for n in (0, 1, 5, 17):
        for world in (1, 2, 3, 4, 6):
            pieces = [_chunk(n, world, r) for r in range(world)]
            assert pieces[0][0] == 0 and pieces[-1][1] == n
            assert all(a[1] == b[0] for a, b in pairwise(pieces))


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_all_gather_broadcast(world):
    n = 5

    def body(rank, comm):
        send = rank_data(rank, n * world)
        shard = np.empty(n, np.float32)
        comm.reduce_scatter(send, shard)
        gathered = np.empty(n * world, np.float32)
        comm.all_gather(shard, gathered)
        root_buf = np.full(3, float(rank), np.float32)
        comm.broadcast(root_buf, root=world - 1)
        comm.barrier()
        return shard, gathered, root_buf

    out = run_thread_ranks(world, body)
    total = sum(rank_data(r, n * world) for r in range(world))
    for rank, (shard, gathered, root_buf) in enumerate(out):
        np.testing.assert_allclose(shard, total[rank * n:(rank + 1) * n], rtol=1e-6)
        np.testing.assert_allclose(gathered, total, rtol=1e-6)
        assert np.all(root_buf == world - 1)


def test_a_failing_rank_releases_the_others_and_is_reported():
    def body(rank, comm):
        if rank == 1:
            raise ValueError("rank one broke")
        buf = np.ones(4, np.float32)
        comm.all_reduce(buf)  # would wait forever for rank 1
        return buf

    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_thread_ranks(3, body, timeout_s=60)
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 1 and str(info.value.error) == "rank one broke"


def test_a_stuck_rank_times_out_with_a_clear_message():
    release = threading.Event()

    def body(rank, comm):
        if rank == 0:
            release.wait(10)  # stuck outside any collective
            return None
        comm.barrier()

    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_thread_ranks(2, body, timeout_s=0.5)
    release.set()
    assert time.monotonic() - t0 < 10
    assert isinstance(info.value.error, CommAborted)
    assert "waited more than 0.5 s in barrier: a peer rank is stuck or dead" in str(info.value.error)


def test_abort_makes_later_collectives_fail():
    group = LocalGroup(2)
    group.abort("test")
    with pytest.raises(CommAborted, match="test"):
        group.communicator(0).barrier()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("in_place", [False, True])
def test_variable_count_reduce_scatter_and_all_gather(world, in_place):
    """Uneven shares, one of them empty (ZeRO-1 buckets that miss a rank's shard), in place or not."""
    counts = [5, 0, 3, 1][:world]
    counts[-1] += 2  # the sizes do not divide evenly
    offsets = shard_offsets(sum(counts), world, counts)
    n = offsets[-1]

    def body(rank, comm):
        send = rank_data(rank, n, seed=2)
        original = send.copy()
        lo, hi = offsets[rank], offsets[rank + 1]
        shard = send[lo:hi] if in_place else np.full(hi - lo, np.nan, np.float32)
        comm.reduce_scatter(send, shard, counts)
        outside = np.concatenate([send[:lo], send[hi:]])
        assert outside.tobytes() == np.concatenate([original[:lo], original[hi:]]).tobytes()  # untouched
        gathered = send if in_place else np.full(n, np.nan, np.float32)
        if in_place:
            gathered[:lo] = gathered[hi:] = np.nan  # must all be filled by the gather
        comm.all_gather(shard, gathered, counts)
        return shard.copy(), gathered

    expected = ordered_sum([rank_data(r, n, seed=2) for r in range(world)])
    for rank, (shard, gathered) in enumerate(run_thread_ranks(world, body)):
        assert shard.tobytes() == expected[offsets[rank]:offsets[rank + 1]].tobytes()
        assert gathered.tobytes() == expected.tobytes()


def test_bad_counts_are_rejected():
    assert shard_offsets(6, 3) == [0, 2, 4, 6]
    assert shard_offsets(5, 2, [5, 0]) == [0, 5, 5]
    with pytest.raises(ValueError, match="do not split into 2 equal shares"):
        shard_offsets(5, 2)
    with pytest.raises(ValueError, match=r"counts \[2, 2\] do not split 5 elements over 2 ranks"):
        shard_offsets(5, 2, [2, 2])

    def body(rank, comm):
        comm.reduce_scatter(np.zeros(4, np.float32), np.zeros(3, np.float32), [2, 2])

    with pytest.raises(RankFailed, match="recv has 3 elements, its share is 2"):
        run_thread_ranks(2, body)


class StepClock:
    """A clock whose marks are ticks of a counter, as a GPU's events are points in its stream's order:
    the communicator must turn marks into seconds only through elapsed(), and only at take()."""

    def __init__(self):
        self.ticks, self.elapsed_calls = 0, 0

    def timestamp(self):
        self.ticks += 1
        return self.ticks

    def elapsed(self, start, end):
        self.elapsed_calls += 1
        return (end - start) * 0.5


class Recorder:
    rank, world_size = 0, 1

    def __init__(self, clock):
        self.clock = clock

    def all_reduce(self, buf):
        self.clock.ticks += 3  # the collective moves the clock 3 ticks; with the end mark's tick its span is 4


def test_timed_communicator_counts_spans_on_its_clock_and_only_the_owners_as_exposed():
    from xtrain_dist.comm.timed import TimedCommunicator
    clock = StepClock()
    timed = TimedCommunicator(Recorder(clock), clock=clock)
    timed.all_reduce(None)                              # the rank's own thread: on the critical path
    side = threading.Thread(target=timed.all_reduce, args=(None,))
    side.start()                                        # a communication thread's: hidden
    side.join()
    timed.waited(10, 14)                                # the rank stood still for 4 ticks
    assert clock.elapsed_calls == 0, "marks must stay marks until take()"
    comm_s, exposed_s, calls = timed.take()
    assert (comm_s, exposed_s, calls) == (2 * 2.0, 2.0 + 2.0, 2)  # 4 ticks: 2 "seconds"
    assert timed.take() == (0.0, 0.0, 0)
