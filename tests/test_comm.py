"""The in-process communicator and the thread launcher: correct sums, identical bits on every rank,
and collective failure (a dying or stuck rank ends the run instead of hanging it)."""

import socket
import threading
import time
from itertools import pairwise

import numpy as np
import pytest

from xtrain_dist.comm import CommAborted, local, shard_offsets
from xtrain_dist.comm.hybrid import HybridCommunicator
from xtrain_dist.comm.local import LocalGroup, _chunk
from xtrain_dist.comm.tcp import TcpCommunicator
from xtrain_dist.train.launch import RankFailed, run_thread_ranks


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


@pytest.mark.parametrize("call", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"])
def test_after_an_abort_every_collective_fails_also_in_a_world_of_one(call):
    """A world of one has nobody to wait for, but an abort (Ctrl-C) must still stop its rank at the next call."""
    group = LocalGroup(1)
    group.abort("interrupted")
    group.abort("a later reason")  # the first reason is the one reported
    with pytest.raises(CommAborted) as info:
        call_alone(group.communicator(0), call)
    assert str(info.value).endswith("aborted: interrupted")


def call_alone(comm, call: str):
    """The collective `call` on small buffers sized for a world of one: where an abort must stop the call
    before it starts, the sizes are never checked against the world."""
    buf = np.zeros(4, np.float32)
    args = {"all_reduce": (buf,), "reduce_scatter": (buf, buf.copy()), "all_gather": (buf, buf.copy()),
            "broadcast": (buf,), "barrier": ()}[call]
    return getattr(comm, call)(*args)


def test_the_peers_of_a_failing_rank_are_released_and_told_which_rank_failed():
    """Rank 1 dies; rank 0, already waiting, and rank 2, arriving after rank 0 has failed in turn, must
    both be released by the abort (not by the launcher's grace period) and blame rank 1, not rank 0."""
    seen = {}

    def body(rank, comm):
        if rank == 1:
            raise ValueError("rank one broke")
        if rank == 2:
            time.sleep(0.3)
        try:
            comm.all_reduce(np.ones(4, np.float32))
        except CommAborted as e:
            seen[rank] = str(e)
            raise

    with pytest.raises(RankFailed) as info:
        run_thread_ranks(3, body, timeout_s=60, grace_s=2.0)
    assert info.value.rank == 1
    assert seen == {0: "all_reduce aborted: rank 1 failed", 2: "all_reduce aborted: rank 1 failed"}


def test_of_several_failing_ranks_the_lowest_is_reported_whichever_failed_first():
    def body(rank, comm):
        if rank == 1:
            time.sleep(0.3)  # rank 2 has failed by now
        if rank > 0:
            raise ValueError(f"rank {rank} broke")
        comm.barrier()

    with pytest.raises(RankFailed) as info:
        run_thread_ranks(3, body, timeout_s=60)
    assert info.value.rank == 1 and str(info.value) == "rank 1: rank 1 broke"


def tcp_pair(timeout_s=10.0, gate=None):
    """Rank 0's and rank 1's TcpCommunicator of a world of 2, over a loopback connection. With a gate, rank 1
    receives nothing until the gate is set: what rank 0 makes of rank 1's messages does not race rank 1."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        to_0 = socket.create_connection(server.getsockname())
        to_1, _ = server.accept()
    if gate is not None:
        to_0 = GatedSocket(to_0, gate)
    return TcpCommunicator(0, 2, [None, to_1], timeout_s), TcpCommunicator(1, 2, [to_0], timeout_s)


class GatedSocket:
    def __init__(self, sock, gate):
        self.sock, self.gate = sock, gate

    def recv_into(self, *args):
        self.gate.wait(10)
        return self.sock.recv_into(*args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def run_pair(comm_0, comm_1, body_0, body_1, gate=None):
    """Run the two ranks on threads; return what each raised (None if it returned)."""
    raised = [None, None]

    def run(rank, comm, body):
        try:
            body(comm)
        except CommAborted as e:
            raised[rank] = str(e)
        finally:
            if rank == 0 and gate is not None:
                gate.set()

    threads = [threading.Thread(target=run, args=(r, c, b)) for r, (c, b) in enumerate(
        [(comm_0, body_0), (comm_1, body_1)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    comm_0.close()
    comm_1.close()
    return raised


def test_tcp_refuses_a_peer_with_another_buffer_size():
    comm_0, comm_1 = tcp_pair(timeout_s=5)
    raised = run_pair(comm_0, comm_1, lambda c: c.all_reduce(np.ones(8, np.float32)),
                      lambda c: c.all_reduce(np.ones(4, np.float32)))
    assert raised[0] == ("all_reduce aborted: rank 1 sent 16 bytes in all_reduce where rank 0 expects 32: "
                         "the processes disagree on the buffer size")
    # told by the connection rank 0 closed as it aborted, not by its own timeout
    assert raised[1].startswith("all_reduce aborted: the connection to rank 0 broke in all_reduce"), raised[1]


def test_tcp_refuses_a_peer_one_collective_behind():
    """Rank 1 skipped a broadcast: its all_reduce #1 meets rank 0's all_reduce #2, the same operation, and
    must not be summed into it."""
    gate = threading.Event()
    comm_0, comm_1 = tcp_pair(gate=gate)

    def rank_0(comm):
        comm.broadcast(np.zeros(2, np.float32))
        comm.all_reduce(np.ones(4, np.float32))

    raised = run_pair(comm_0, comm_1, rank_0, lambda c: c.all_reduce(np.ones(4, np.float32)), gate)
    assert raised[0] == ("all_reduce aborted: rank 1 is in all_reduce #1 while rank 0 is in all_reduce #2: "
                         "the processes call collectives in different orders")
    assert raised[1] is not None


@pytest.mark.skipif(not hasattr(__import__("select"), "POLLRDHUP"), reason="the kernel is asked on Linux only")
def test_a_live_tcp_peer_whose_bytes_another_thread_took_is_not_taken_for_dead(monkeypatch):
    """The liveness probe runs beside other threads reading the same sockets (a group's, the gradient sync's): a
    socket that was readable when one thread looked may have been read empty by another before it peeks. Such a
    peek waited out the socket's timeout and named the live peer dead; the probe must not read at all."""
    from xtrain_dist.comm import tcp
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname())
        mine = server.accept()[0]
    mine.settimeout(1)
    monkeypatch.setattr(tcp.select, "select", lambda r, w, x, t=None: (r, w, x))  # readable, as it once was
    t0 = time.monotonic()
    assert tcp._closed_peer([None, mine]) is None and time.monotonic() - t0 < 0.5
    peer.sendall(b"last")  # a peer that sent its last bytes and closed: gone once they are read, not before
    peer.close()
    time.sleep(0.05)
    assert tcp._closed_peer([None, mine]) is None
    mine.recv(4)
    assert tcp._closed_peer([None, mine]) == 1
    mine.close()


class HybridGroup:
    """`processes` processes of `threads` rank threads each, all in this process: each process's threads a
    LocalGroup, its leaders joined by another LocalGroup that stands in for MPI or TCP. Fits run_thread_ranks."""

    def __init__(self, processes: int, threads: int):
        self.threads = threads
        self.locals = [LocalGroup(threads, timeout_s=30) for _ in range(processes)]
        self.inter = LocalGroup(processes, timeout_s=30)

    def communicator(self, rank: int) -> HybridCommunicator:
        process, thread = divmod(rank, self.threads)
        return HybridCommunicator(self.locals[process].communicator(thread), self.inter.communicator(process),
                                  process, self.threads)

    def abort(self, reason: str) -> None:
        for group in (*self.locals, self.inter):
            group.abort(reason)


@pytest.mark.parametrize("processes, threads", [(3, 2), (2, 3)])
def test_hybrid_collectives_over_threads_inside_processes(processes, threads):
    """Global rank = process x threads + thread, for any shape of the world: the process count and the
    threads per process differ here (2 x 2, the only shape the MPI test runs, cannot tell them apart)."""
    world = processes * threads
    counts = [(r % 3) * 2 + 1 for r in range(world)]
    counts[1] = 0  # a rank owning nothing, as ZeRO-1's buckets do
    offsets = shard_offsets(sum(counts), world, counts)
    n = offsets[-1]

    def body(rank, comm):
        assert (comm.rank, comm.world_size) == (rank, world)
        summed = rank_data(rank, 1000, seed=3)
        comm.all_reduce(summed)
        send = rank_data(rank, n, seed=4)
        shard = np.full(counts[rank], np.nan, np.float32)
        comm.reduce_scatter(send, shard, counts)
        assert send.tobytes() == rank_data(rank, n, seed=4).tobytes(), "reduce_scatter changed its send buffer"
        gathered = np.full(n, np.nan, np.float32)
        comm.all_gather(np.full(counts[rank], rank, np.float32), gathered, counts)
        roots = []
        for root in range(world):
            buf = np.full(2, rank, np.float32)
            comm.broadcast(buf, root=root)
            roots.append(buf.tolist())
        comm.barrier()
        return summed, shard, gathered, roots

    def process_order_sum(n, seed):  # each process sums its threads, then the processes add up in order
        return ordered_sum([ordered_sum([rank_data(p * threads + t, n, seed) for t in range(threads)])
                            for p in range(processes)])

    summed_expected, send_expected = process_order_sum(1000, 3), process_order_sum(n, 4)
    for rank, (summed, shard, gathered, roots) in enumerate(run_thread_ranks(world, body, group=HybridGroup(
            processes, threads))):
        assert summed.tobytes() == summed_expected.tobytes()
        assert shard.tobytes() == send_expected[offsets[rank]:offsets[rank + 1]].tobytes()
        assert gathered.tolist() == [float(r) for r in range(world) for _ in range(counts[r])]
        assert roots == [[float(root)] * 2 for root in range(world)]


def test_a_collective_that_completed_is_not_undone_by_an_abort_right_after_it():
    """Every rank of a run that diverges leaves the step's all-reduce and raises; the first to raise aborts
    the group. A rank the all-reduce had released but that had not woken yet raised CommAborted in it
    (threading.Barrier breaks late waiters too): rank 0 then lost its progress line, and the error named
    whichever rank came first (tests/test_cli.py's divergence test failed one run in ten)."""
    def rank(r, group, sums):
        buf = np.ones(4, np.float32)
        group.communicator(r).all_reduce(buf)
        if r == 1:  # the first to leave the collective fails at once
            group.abort("rank 1 failed")
        sums[r] = buf.tolist()

    for _ in range(20):
        group, sums = LocalGroup(2, timeout_s=10), {}
        threads = [threading.Thread(target=rank, args=(r, group, sums)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sums == {0: [2.0] * 4, 1: [2.0] * 4}
        with pytest.raises(CommAborted, match="rank 1 failed"):  # what comes after the abort fails
            group.communicator(0).all_reduce(np.ones(4, np.float32))


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
    """... and the payload of each group it times: an all-reduce's buffer, by the label of the communicator
    that ran it (a group of the rank's mesh timed into the same marks)."""
    from xtrain_dist.comm.timed import TimedCommunicator
    clock = StepClock()
    timed = TimedCommunicator(Recorder(clock), clock=clock)
    tp = timed.timing(Recorder(clock), "tp")
    timed.all_reduce(np.zeros(3, np.float32))           # the rank's own thread: on the critical path
    side = threading.Thread(target=timed.all_reduce, args=(np.zeros(5, np.float64),))
    side.start()                                        # a communication thread's: hidden
    side.join()
    timed.waited(10, 14)                                # the rank stood still for 4 ticks
    assert clock.elapsed_calls == 0, "marks must stay marks until take()"
    marks = timed.detach()
    assert timed.payload(marks) == {"dp": 12 + 40}
    comm_s, exposed_s, calls = timed.tally(marks)
    assert (comm_s, exposed_s, calls) == (2 * 2.0, 2.0 + 2.0, 2)  # 4 ticks: 2 "seconds"
    tp.all_reduce(np.zeros(2, np.float32))
    marks = timed.detach()
    assert timed.payload(marks) == {"tp": 8} and timed.calls(marks) == 1
    timed.all_reduce(np.zeros(1, np.float32))
    comm_s, exposed_s, calls = timed.take()
    assert (comm_s, exposed_s, calls) == (2.0, 2.0, 1)
    assert timed.take() == (0.0, 0.0, 0)


# ------------------------------------------------------------------ what mutation testing found untested
def test_tcp_names_a_peer_that_does_not_answer_in_time():
    comm_0, comm_1 = tcp_pair(timeout_s=0.5)
    t0 = time.monotonic()
    raised = run_pair(comm_0, comm_1, lambda c: c.all_reduce(np.ones(4, np.float32)), lambda c: None)
    assert raised[0] == ("all_reduce aborted: rank 0 waited more than 0.5 s for rank 1 in all_reduce: a peer process "
                         "is stuck or dead")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("call", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"])
def test_tcp_after_an_abort_every_collective_fails_also_in_a_world_of_one(call):
    comm = TcpCommunicator(0, 1, [None])
    comm.abort("interrupted")
    with pytest.raises(CommAborted) as info:
        call_alone(comm, call)
    assert str(info.value).endswith("aborted: interrupted")


def test_tcp_reduce_scatter_leaves_its_send_buffer_as_it_was():
    comm_0, comm_1 = tcp_pair()
    sends = [rank_data(r, 6) for r in range(2)]
    shards = [np.empty(3, np.float32) for _ in range(2)]
    raised = run_pair(comm_0, comm_1, lambda c: c.reduce_scatter(sends[0], shards[0]),
                      lambda c: c.reduce_scatter(sends[1], shards[1]))
    assert raised == [None, None]
    assert [s.tobytes() for s in sends] == [rank_data(r, 6).tobytes() for r in range(2)]
    total = sends[0] + sends[1]
    assert [s.tobytes() for s in shards] == [total[:3].tobytes(), total[3:].tobytes()]


def test_hybrid_barrier_holds_every_thread_until_every_rank_arrived():
    """Not only the leaders: a thread that left before the last rank of another process arrived would run
    ahead of it. (The sleep only makes a wrong barrier show; a right one passes whatever the timing.)"""
    entered = [False] * 4

    def body(rank, comm):
        if rank == 3:
            time.sleep(0.3)  # the last to arrive: a thread of the other process, not its leader
        entered[rank] = True
        comm.barrier()
        return list(entered)

    for seen in run_thread_ranks(4, body, group=HybridGroup(2, 2)):
        assert seen == [True] * 4


def test_hybrid_abort_reaches_the_other_processes():
    group = HybridGroup(2, 2)
    group.communicator(1).abort("rank 1 failed")  # process 0's second thread: not its leader
    with pytest.raises(CommAborted, match="rank 1 failed"):
        group.inter.communicator(1).barrier()  # process 1's leader, across processes


def test_ctrl_c_aborts_the_ranks_waiting_in_a_collective(monkeypatch):
    """Ctrl-C reaches the launcher's thread while it waits for the ranks: it must abort the group, so a rank
    blocked in a collective ends at once instead of at the communicator's timeout (here 60 s). The
    interrupt is raised by the launcher's first wait for a rank, so it comes while the ranks run."""
    import threading as real_threading

    from xtrain_dist.train import launch as launch_module

    class InterruptedThread(real_threading.Thread):
        interrupted = False

        def join(self, timeout=None):
            if timeout == 0.05 and not InterruptedThread.interrupted:
                InterruptedThread.interrupted = True
                raise KeyboardInterrupt
            return super().join(timeout)

    monkeypatch.setattr(launch_module, "threading", type("T", (), {"Thread": InterruptedThread,
                                                                    "Lock": real_threading.Lock}))
    seen = {}

    def body(rank, comm):
        if rank == 0:
            try:
                comm.barrier()  # rank 1 never comes
            except CommAborted as e:
                seen[rank] = str(e)
                raise

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_thread_ranks(2, body, timeout_s=60)
    assert seen == {0: "barrier aborted: interrupted"}
    assert time.monotonic() - t0 < 4  # not the launcher's 5 s join of a rank that never ended


# the MPI communicator's waiting, without MPI: a stand-in request that never completes
def mpi_comm(timeout_s):
    from xtrain_dist.comm.mpi import MpiCommunicator
    comm = MpiCommunicator.__new__(MpiCommunicator)  # no MPI_Init: only the logic around the requests
    comm.rank, comm.world_size, comm.timeout_s, comm.abort_reason, comm.comm = 1, 2, timeout_s, None, None
    return comm


class NeverDone:
    def __init__(self, on_test=None):
        self.tests, self.on_test = 0, on_test

    def Test(self):  # mpi4py's name
        self.tests += 1
        if self.on_test:
            self.on_test(self.tests)
        return False


def bounded(fn, seconds=10):
    """fn() on a daemon thread; what it raised (or None), or a failure if it is still running after `seconds`."""
    outcome = []

    def run():
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # handed back
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    return outcome[0]


def test_mpi_a_collective_that_never_completes_times_out():
    comm = mpi_comm(0.3)
    error = bounded(lambda: comm._wait(NeverDone(), "all_reduce"))
    assert isinstance(error, CommAborted)
    assert str(error) == ("all_reduce aborted: rank 1 waited more than 0.3 s in all_reduce: a peer process is stuck "
                          "or dead")


def test_mpi_an_abort_ends_a_pending_collective():
    comm = mpi_comm(60)
    request = NeverDone(lambda n: n == 3 and comm.abort("rank 0 failed"))  # another thread aborts meanwhile
    error = bounded(lambda: comm._wait(request, "broadcast"))
    assert isinstance(error, CommAborted) and str(error) == "broadcast aborted: rank 0 failed"


@pytest.mark.parametrize("call", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"])
def test_mpi_after_an_abort_no_collective_starts(call):
    comm = mpi_comm(60)
    comm.abort("rank 0 failed")
    with pytest.raises(CommAborted) as info:
        call_alone(comm, call)
    assert str(info.value) == f"{call} aborted: rank 0 failed"
