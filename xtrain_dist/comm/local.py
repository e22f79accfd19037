"""The in-process communicator: ranks are threads of one process and exchange buffers by reference.

A collective is two barriers around a copy: every rank posts its buffer, then each rank reduces its
own 1/world chunk *across all ranks' buffers* in rank order 0, 1, ..., world-1 and writes the result
into every rank's buffer. The work is split like a ring all-reduce's, numpy releases the GIL in the
arithmetic so the chunks really run in parallel, and the fixed summation order means every rank gets
identical bits, whatever the chunking. Buffers may be numpy or CuPy arrays (virtual ranks sharing a
GPU): device work is synchronised before a buffer is posted and after it is written.
"""

import threading

from . import CommAborted


def _sync_device(buf) -> None:
    """Wait for the calling thread's stream, so a peer reading buf sees finished values."""
    if hasattr(buf, "__cuda_array_interface__"):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def _chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's share of n elements; the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class LocalGroup:
    """The state the thread ranks of one process share."""

    def __init__(self, world_size: int, timeout_s: float = 300.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size)
        self._posted = [None] * world_size
        self.abort_reason: str | None = None

    def communicator(self, rank: int) -> "LocalCommunicator":
        return LocalCommunicator(self, rank)

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        self._barrier.abort()


class LocalCommunicator:
    def __init__(self, group: LocalGroup, rank: int):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    # ---------------------------------------------------------------- synchronisation
    def _wait(self, what: str) -> None:
        group = self.group
        try:
            group._barrier.wait(group.timeout_s)
        except threading.BrokenBarrierError:
            if group.abort_reason is None:  # the barrier broke by timing out
                group.abort_reason = (f"rank {self.rank} waited more than {group.timeout_s:g} s in {what}: "
                                      "a peer rank is stuck or dead")
            raise CommAborted(f"{what} aborted: {group.abort_reason}") from None

    def _post(self, buf, what: str):
        """Post buf for the peers; return every rank's posted buffer once all have posted."""
        _sync_device(buf)
        self.group._posted[self.rank] = buf
        self._wait(what)
        return list(self.group._posted)

    def _done(self, buf, what: str) -> None:
        """Nobody returns (and reuses a buffer) until every rank has finished reading and writing."""
        _sync_device(buf)
        self._wait(what)

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, buf) -> None:
        if self.world_size == 1:
            return self._check()
        flat = buf.reshape(-1)
        bufs = [b.reshape(-1) for b in self._post(buf, "all_reduce")]
        lo, hi = _chunk(flat.size, self.world_size, self.rank)
        if hi > lo:
            total = bufs[0][lo:hi].copy()
            for other in bufs[1:]:
                total += other[lo:hi]
            for b in bufs:
                b[lo:hi] = total
        self._done(buf, "all_reduce")

    def reduce_scatter(self, send, recv) -> None:
        n = recv.size
        sends = [s.reshape(-1) for s in self._post(send, "reduce_scatter")]
        lo = self.rank * n
        out = recv.reshape(-1)
        out[...] = sends[0][lo:lo + n]
        for other in sends[1:]:
            out += other[lo:lo + n]
        self._done(recv, "reduce_scatter")

    def all_gather(self, send, recv) -> None:
        n = send.size
        sends = self._post(send, "all_gather")
        out = recv.reshape(-1)
        for r, s in enumerate(sends):
            out[r * n:(r + 1) * n] = s.reshape(-1)
        self._done(recv, "all_gather")

    def broadcast(self, buf, root: int = 0) -> None:
        bufs = self._post(buf, "broadcast")
        if self.rank != root:
            buf[...] = bufs[root]
        self._done(buf, "broadcast")

    def barrier(self) -> None:
        if self.world_size > 1:
            self._wait("barrier")
        self._check()

    def abort(self, reason: str) -> None:
        self.group.abort(reason)

    def _check(self) -> None:
        if self.group.abort_reason is not None:
            raise CommAborted(f"aborted: {self.group.abort_reason}")
