"""The MPI communicator: CPU processes (mpirun / mpiexec) exchanging numpy buffers through mpi4py.

Why not one MPI_Allreduce. The MPI standard requires all processes to receive identical results but
leaves the order of the floating-point sum to the implementation, which picks an algorithm per call
(MPICH: recursive doubling, reduce-scatter + allgather, ring, ... by message size and process count,
overridable with MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM). The bits would then change with the MPI library,
its version, the buffer size and a tuning variable, would differ from the thread communicator's, and
"identical on every rank" would rest on each algorithm's implementation. So the all-reduce is spelt
out as the thread communicator's:

    1. exchange: rank r receives chunk r of every rank's buffer (chunk r has one owner);
    2. the owner sums the world copies of its chunk in rank order 0, 1, ..., world-1 (numpy, elementwise);
    3. Iallgatherv: every rank receives every owner's summed chunk, in place.

Each element is added exactly once, by one process, in a fixed order; the other ranks only copy it.
The traffic per rank is that of a ring all-reduce, 2(world-1)/world of the buffer.

Step 1 is one Irecv and one Isend per peer, not MPI_Ialltoallv. MPICH 5.0 (ch4, processes on one node)
moves an Ialltoallv only inside MPI calls and about 8 KiB per call: 6417 Tests for a 100 MiB all-reduce
at world 2, whatever MPIR_CVAR_IALLTOALLV_INTRA_ALGORITHM says. The polled wait below sleeps between
Tests once it has spun a while, so each 8 KiB then cost a sleep: 3.5 s per 100 MiB all-reduce, where the
point-to-point messages (a rendezvous the library completes as a whole) need 1 to 3 Tests however large.
Iallgatherv and Ibcast finish in a few Tests at any size, so they stay collectives.

No call blocks forever: every exchange is non-blocking, polled until done, the communicator
is aborted, or the timeout passes. A rank that fails ends the job with MPI_Abort (`abort_job`), so a
peer never waits in a collective for a process that has already given up.
"""

import importlib.util
import sys
import time

import numpy as np

from ..errors import XtrainError, install_hint
from . import CommAborted, check_peer, check_split, rank_share_offsets
from .local import _chunk


def _missing(why) -> XtrainError:
    return XtrainError(f"the MPI communicator needs mpi4py and an MPI library: {why} ({install_hint('mpi')})")


def check_installed() -> None:
    """Fail now if mpi4py is missing, without importing mpi4py.MPI (which starts MPI itself)."""
    if importlib.util.find_spec("mpi4py") is None:
        raise _missing("No module named 'mpi4py'")


def mpi_module():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise _missing(e) from None
    return MPI


ABORT_GRACE_S = 0.5  # abort_job's wait between the failing process's line and MPI_Abort


def abort_job(code: int = 1) -> None:
    """End every process of the MPI job (MPI_Abort) if this process is one of several; else do nothing.
    Called after the failing process has printed its line: a peer then never waits for a dead job."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:  # it failed before it joined MPI (bad input): join now, or the peers wait in MPI
        from .launch_env import detect_launch
        try:
            if detect_launch().kind != "mpirun":
                return
            from mpi4py import MPI
        except (ImportError, XtrainError):
            return
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # the launcher forwards a process's output over its own connection, and MPI_Abort tears the job down at
    # once: without a moment for the line to go out, mpiexec sometimes printed nothing of it (2 runs in 5 of
    # a two-process mismatch on a loaded 2-core machine)
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)


# The tag of the all-reduce and reduce-scatter exchange, apart from send/recv's (MPI's default, 0): a
# collective's messages never match a point-to-point receive posted between the same two processes.
EXCHANGE_TAG = 1
# _wait: Tests back to back (a fraction of a millisecond at 100), then a nap between Tests. Where the processes
# outnumber the cores, a waiting process's spin holds a core its peer needs to send: `mpirun -n 4 ...
# train_ddp 12 8 32 --seed 7 --eval-batches 0` on 2 cores took 114 ms a step at 1000 spins and 41 at 100 (ZeRO-1
# 48 and 26, ZeRO-3 345 and 154); with a core a process (-n 2), 14 ms a step either way (2026-11-29).
SPIN_POLLS, NAP_S = 100, 0.0005


class MpiCommunicator:
    _parent = None  # the communicator this one was split from: an abort of either reaches both
    # a split's ranks as the job numbers them (MPI_COMM_WORLD's), by rank in the split; None: the world's own.
    # A failure line names job-wide ranks: the line's prefix ("rank N stopped:") is one, and a rank of a
    # tensor- or pipeline-parallel group after it would point at another, live process
    job_ranks: list[int] | None = None
    unfinished_tests = 0  # Tests that found a request still pending, this communicator's lifetime
    _received = None  # _receive_buffer's

    def __init__(self, comm=None, timeout_s: float = 300.0):
        MPI = self.MPI = mpi_module()
        # Rank threads call MPI, and they are not the main thread: MPI must allow that.
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise XtrainError("the MPI library was initialised without thread support (MPI_THREAD_SERIALIZED "
                              "or better is needed: rank threads make the MPI calls)")
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout_s = timeout_s
        self.abort_reason: str | None = None

    @property
    def concurrent_groups(self) -> bool:
        """Whether two threads of the process may be in MPI calls at once, on different communicators (as a
        tensor-parallel rank's thread all-reducing over its group while its gradient sync's thread reduces
        over the data-parallel one): MPI_THREAD_MULTIPLE, which MPI_THREAD_SERIALIZED is not."""
        return self.MPI.Query_thread() >= self.MPI.THREAD_MULTIPLE

    def _reason(self) -> str | None:
        """Why this communicator, or one it was split from, was aborted (None: it was not)."""
        comm = self
        while comm is not None:
            if comm.abort_reason is not None:
                return comm.abort_reason
            comm = comm._parent
        return None

    def _job(self, rank: int) -> str:
        """`rank` of this communicator as a failure line names it: its rank in the job."""
        return f"rank {self.job_ranks[rank] if self.job_ranks is not None else rank}"

    def _among(self) -> str:
        """Where a collective of a split runs, for a failure line: its ranks, job-wide."""
        return "" if self.job_ranks is None else f" among ranks {', '.join(map(str, self.job_ranks))}"

    def _wait(self, request, what: str, status=None, stuck: str = "a peer process is stuck or dead") -> None:
        deadline = time.monotonic() + self.timeout_s
        polls = 0
        while not (request.Test() if status is None else request.Test(status)):
            if self._reason() is not None:
                raise CommAborted(f"{what} aborted: {self._reason()}")
            if time.monotonic() > deadline:
                self.abort(f"{self._job(self.rank)} waited more than {self.timeout_s:g} s in {what}{self._among()}: "
                           f"{stuck}")
                raise CommAborted(f"{what} aborted: {self._reason()}")
            polls += 1
            self.unfinished_tests += 1
            time.sleep(0 if polls < SPIN_POLLS else NAP_S)  # spin briefly, then stop burning a core

    def _check(self, what: str) -> None:
        if self._reason() is not None:
            raise CommAborted(f"{what} aborted: {self._reason()}")

    def _chunks(self, n: int) -> tuple[list[int], list[int]]:
        bounds = [_chunk(n, self.world_size, r) for r in range(self.world_size)]
        return [hi - lo for lo, hi in bounds], [lo for lo, _ in bounds]

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, buf) -> None:
        self._check("all_reduce")
        if self.world_size == 1:
            return
        flat = _flat(buf)
        counts, offsets = self._chunks(flat.size)
        mine = counts[self.rank]
        lo = offsets[self.rank]
        self._reduce_share(flat, counts, offsets, flat[lo:lo + mine], "all_reduce")
        self._wait(self.comm.Iallgatherv(self.MPI.IN_PLACE, [flat, (counts, offsets)]), "all_reduce")

    def reduce_scatter(self, send, recv, counts=None) -> None:
        """recv = the rank-order sum of every rank's share `rank` of send (recv may be that share itself)."""
        self._check("reduce_scatter")
        flat, world = _flat(send), self.world_size
        offsets = rank_share_offsets(flat.size, world, self.rank, counts, recv.size, "recv")
        sizes = [offsets[r + 1] - offsets[r] for r in range(world)]
        self._reduce_share(flat, sizes, offsets[:-1], _flat(recv), "reduce_scatter")

    def _reduce_share(self, flat, sizes, offsets, out, what: str) -> None:
        """Steps 1 and 2 of the all-reduce: out = the rank-order sum of every rank's values of this rank's
        share of flat (sizes[rank] elements at offsets[rank]; out may be that share itself). Step 1 is an
        all-to-all by point-to-point messages; this rank's own values are read where they are, not copied."""
        rank, world = self.rank, self.world_size
        mine = sizes[rank]
        own = flat[offsets[rank]:offsets[rank] + mine]
        peers = [r for r in range(world) if r != rank]
        theirs = dict(zip(peers, self._receive_buffer(world - 1, mine, flat.dtype), strict=True))  # rank r's values
        requests = [self.comm.Irecv(theirs[r], source=r, tag=EXCHANGE_TAG) for r in peers]
        requests += [self.comm.Isend(flat[offsets[r]:offsets[r] + sizes[r]], dest=r, tag=EXCHANGE_TAG)
                     for r in peers]
        self._wait(_AllOf(self.MPI, requests), what)
        # ((b0 + b1) + b2) + ...: the ranks before this one are summed first, then this rank's values are
        # added to that prefix (IEEE addition commutes: prefix + own and own + prefix are the same bits)
        if rank == 0:
            out[...] = own
        else:
            prefix = theirs[0]
            for r in range(1, rank):
                prefix += theirs[r]
            np.add(prefix, own, out=out)
        for r in range(rank + 1, world):
            out += theirs[r]

    def _receive_buffer(self, rows: int, n: int, dtype):
        """rows x n elements, kept from call to call as the ring's scratch is: a fresh 50 MiB buffer per
        100 MiB all-reduce costs its page faults every time (about a third of the call at world 2)."""
        size = rows * n
        if self._received is None or self._received.size < size or self._received.dtype != dtype:
            self._received = np.empty(size, dtype)
        return self._received[:size].reshape(rows, n)

    def all_gather(self, send, recv, counts=None) -> None:
        """recv's share r = rank r's send, for every r (send may be recv's own share)."""
        self._check("all_gather")
        out, world = _flat(recv), self.world_size
        offsets = rank_share_offsets(out.size, world, self.rank, counts, send.size, "send")
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        out[lo:hi] = send.reshape(-1)  # then in place: MPI forbids a send buffer inside the receive buffer
        sizes = [offsets[r + 1] - offsets[r] for r in range(world)]
        self._wait(self.comm.Iallgatherv(self.MPI.IN_PLACE, [out, (sizes, offsets[:-1])]), "all_gather")

    def broadcast(self, buf, root: int = 0) -> None:
        self._check("broadcast")
        self._wait(self.comm.Ibcast(_flat(buf), root=root), "broadcast")

    def barrier(self) -> None:
        self._check("barrier")
        self._wait(self.comm.Ibarrier(), "barrier")

    # ---------------------------------------------------------------- groups
    def split(self, color: int, key: int | None = None) -> "MpiCommunicator":
        """MPI_Comm_split. The colors and keys are gathered first with the polled all_gather, so a rank
        that never comes is caught by the timeout, not left in a blocking MPI_Comm_split."""
        check_split(color, key)
        self._check("split")
        key = self.rank if key is None else key
        everyone = np.empty(2 * self.world_size, np.int64)
        self.all_gather(np.array([color, key], np.int64), everyone)  # every rank is here: Split cannot hang
        sub = MpiCommunicator(self.comm.Split(color, key), self.timeout_s)
        sub._parent = self
        world = self.MPI.COMM_WORLD.Get_group()
        sub.job_ranks = [int(r) for r in self.MPI.Group.Translate_ranks(sub.comm.Get_group(),
                                                                        list(range(sub.world_size)), world)]
        return sub

    # ---------------------------------------------------------------- point-to-point
    def send(self, buf, peer: int) -> None:
        check_peer(self, peer)
        self._check("send")
        self._wait(self.comm.Isend(_flat(buf), dest=peer), "send",
                   stuck=f"{self._job(peer)} is stuck, dead or never receives")

    def recv(self, buf, peer: int) -> None:
        check_peer(self, peer)
        self._check("recv")
        self._finish_recv(self.comm.Irecv(_flat(buf), source=peer), buf, peer)

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        check_peer(self, dest)
        check_peer(self, source)
        self._check("sendrecv")
        receiving = self.comm.Irecv(_flat(recv), source=source)
        self._wait(self.comm.Isend(_flat(send), dest=dest), "sendrecv",
                   stuck=f"{self._job(dest)} is stuck, dead or never receives")
        self._finish_recv(receiving, recv, source)

    def _finish_recv(self, request, buf, peer: int) -> None:
        status = self.MPI.Status()
        try:
            self._wait(request, "recv", status, stuck=f"{self._job(peer)} is stuck, dead or never sends")
        except self.MPI.Exception as e:  # MPI_ERR_TRUNCATE: the message is longer than buf
            self._disagree(peer, f"more than {buf.size}", buf, e.Get_error_string())
        got = status.Get_count(self.MPI._typedict[buf.dtype.char])
        if got != buf.size:
            self._disagree(peer, str(got), buf)

    def _disagree(self, peer: int, sent: str, buf, detail: str = "") -> None:
        self.abort(f"{self._job(peer)} sent {sent} {buf.dtype} elements where {self._job(self.rank)} receives "
                   f"{buf.size}: "
                   "the ranks disagree on the message" + (f" ({detail.strip()})" if detail else ""))
        self._check("recv")

    def abort(self, reason: str) -> None:
        """Make this process's pending and later collectives raise, on this communicator and on every one
        split from the same world; the job itself ends through abort_job once the failing process has
        said why."""
        root = self
        while root._parent is not None:
            root = root._parent
        if root.abort_reason is None:
            root.abort_reason = reason
        if self.abort_reason is None:
            self.abort_reason = reason

    def close(self) -> None:
        pass


class _AllOf:
    """Several requests polled as one (MPI_Testall)."""

    def __init__(self, MPI, requests):
        self.MPI, self.requests = MPI, requests

    def Test(self):  # mpi4py's name, as _wait calls it
        return self.MPI.Request.Testall(self.requests)


def _flat(buf):
    if not buf.flags.c_contiguous:
        raise ValueError("communicator buffers must be contiguous")
    return buf.reshape(-1)
