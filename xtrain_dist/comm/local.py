"""The in-process communicator: ranks are threads of one process and exchange buffers by reference.

A collective is two barriers around a copy: every rank posts its buffer, then each rank works on its
own part of *every* rank's buffer and nobody else touches that part until the second barrier. For
all_reduce the part is a 1/world chunk: the rank sums it across all ranks' buffers in rank order
0, 1, ..., world-1 and writes the sum into every buffer. The work is split like a ring all-reduce's,
numpy releases the GIL in the arithmetic so the chunks really run in parallel, and the fixed
summation order means every rank gets identical bits, whatever the chunking.

The sums run block by block through a small scratch accumulator that stays in the core's cache:
a chunk is read once from each rank's buffer and written once to each, with no whole-chunk
temporary (that halves the memory traffic of the naive copy-then-add, and memory traffic is all a
CPU all-reduce is). Buffers may be numpy or CuPy arrays (virtual ranks sharing a GPU): device work is
synchronised before a buffer is posted and after it is written.
"""

import threading

import numpy as np

from . import CommAborted, check_peer, check_split, rank_share_offsets, split_members

# Elements summed per pass: 512 KiB of float32, half of this machine's L2, so the accumulator stays
# in cache while each rank's slice of the block streams through it.
BLOCK = 1 << 17


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


class _Barrier:
    """threading.Barrier's wait and abort, except that an abort breaks only the waits it interrupts. With
    threading.Barrier, a rank that the last arrival had released but that had not woken yet raised
    BrokenBarrierError when a faster rank left and aborted at once: a collective that had completed
    failed on some ranks (a diverged run lost rank 0's progress line, and named another rank)."""

    def __init__(self, parties: int):
        self._parties, self._waiting, self._generation, self._broken = parties, 0, 0, False
        self._cond = threading.Condition()

    def wait(self, timeout: float) -> None:
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._waiting += 1
            if self._waiting == self._parties:
                self._waiting, self._generation = 0, generation + 1
                self._cond.notify_all()
                return
            released = self._cond.wait_for(lambda: self._generation != generation or self._broken, timeout)
            if self._generation != generation:  # released, whatever happened since
                return
            if not released:  # timed out: the barrier breaks for every rank, as threading.Barrier's does
                self._broken = True
                self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class _Message:
    """A point-to-point message in a mailbox: its data, and whether the receiver has copied it."""

    def __init__(self, data):
        self.data, self.taken = data, False


class LocalGroup:
    """The state the thread ranks of one process share.

    A group made by split is a child of the group it was split from; all groups split from one world
    are one family, and an abort of any of them aborts every one: a rank waiting in a sub-group for a
    peer whose other group failed is released, not left to hang."""

    def __init__(self, world_size: int, timeout_s: float = 300.0, parent: "LocalGroup | None" = None):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = _Barrier(world_size)
        self._posted = [None] * world_size
        self.abort_reason: str | None = None
        self._root = self if parent is None else parent._root
        # a split's ranks as the world it was split from numbers them, by rank in the split (None: the world):
        # failure lines name world ranks, as the line's "rank N stopped:" prefix does
        self.job_ranks: list[int] | None = None
        self._family: list[LocalGroup] = []
        self._root._family.append(self)
        # point-to-point: one mailbox per (sender, receiver), messages in the order they were sent
        self._mail = {}
        self._mail_ready = threading.Condition()
        self._marks = [{} for _ in range(world_size)]  # each rank's latest share_mark times, by key

    def job(self, rank: int) -> int:
        """`rank` of this group as the world it was split from numbers it."""
        return rank if self.job_ranks is None else self.job_ranks[rank]

    def among(self) -> str:
        """Where a collective of a split runs, for a failure line: its ranks, as the world numbers them."""
        return "" if self.job_ranks is None else f" among ranks {', '.join(map(str, self.job_ranks))}"

    def communicator(self, rank: int) -> "LocalCommunicator":
        return LocalCommunicator(self, rank)

    def abort(self, reason: str) -> None:
        for group in list(self._root._family):
            if group.abort_reason is None:
                group.abort_reason = reason
            group._barrier.abort()
            with group._mail_ready:
                group._mail_ready.notify_all()


class LocalCommunicator:
    def __init__(self, group: LocalGroup, rank: int):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self._scratch = None  # the block accumulator, kept between calls

    # ---------------------------------------------------------------- a shared clock
    # The ranks are threads of one process, so time.perf_counter is one clock for all of them: a rank can tell
    # when each peer reached a point of the step (comm/timed.py: how long it waited for the slowest rank).

    def share_mark(self, key: int, t: float) -> None:
        """Tell the group's ranks that this rank reached point `key` (a count every rank keeps alike) at t."""
        marks = self.group._marks[self.rank]
        marks[key] = t
        marks.pop(key - 4, None)  # a peer reads a key while it is this rank's latest few

    def slowest_mark(self, key: int) -> float | None:
        """The latest t of any rank of the group for `key`, or None if a rank has not shared it (yet, or any
        more). A rank that shared its mark before a collective that this rank has since finished with it is
        never missed."""
        times = [marks.get(key) for marks in self.group._marks]
        return None if None in times else max(times)

    # ---------------------------------------------------------------- synchronisation
    def _wait(self, what: str) -> None:
        group = self.group
        try:
            group._barrier.wait(group.timeout_s)
        except threading.BrokenBarrierError:
            if group.abort_reason is None:  # the barrier broke by timing out: every group of the family ends
                group.abort(f"rank {group.job(self.rank)} waited more than {group.timeout_s:g} s in {what}"
                            f"{group.among()}: "
                            "a peer rank is stuck or dead")
            raise CommAborted(f"{what} aborted: {group.abort_reason}") from None

    def _post(self, buf, what: str):
        """Post buf for the peers; return every rank's posted buffer, flattened, once all have posted."""
        _sync_device(buf)
        self.group._posted[self.rank] = buf
        self._wait(what)
        return [b.reshape(-1) for b in self.group._posted]

    def _done(self, buf, what: str) -> None:
        """Nobody returns (and reuses a buffer) until every rank has finished reading and writing."""
        _sync_device(buf)
        self._wait(what)

    def _accumulator(self, like, n: int):
        s = self._scratch
        if s is None or s.dtype != like.dtype or type(s) is not type(like) or s.size < n:
            s = self._scratch = np.empty_like(like, shape=(n,))
        return s[:n]

    def _sum_into(self, outs, ins, lo: int, hi: int, shift: int = 0) -> None:
        """out[lo-shift:hi-shift] = ((ins[0] + ins[1]) + ins[2]) + ... over [lo, hi), for every out in outs.

        Each block is fully read before any out is written, so an out may be one of the ins."""
        for a in range(lo, hi, BLOCK):
            b = min(a + BLOCK, hi)
            acc = self._accumulator(ins[0], b - a)
            np.add(ins[0][a:b], ins[1][a:b], out=acc)
            for other in ins[2:]:
                np.add(acc, other[a:b], out=acc)
            for out in outs:
                out[a - shift:b - shift] = acc

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, buf) -> None:
        if self.world_size == 1:
            return self._check()
        bufs = self._post(buf, "all_reduce")
        lo, hi = _chunk(bufs[0].size, self.world_size, self.rank)
        self._sum_into(bufs, bufs, lo, hi)
        self._done(buf, "all_reduce")

    def reduce_scatter(self, send, recv, counts=None) -> None:
        offsets = rank_share_offsets(send.size, self.world_size, self.rank, counts, recv.size, "recv")
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        out = recv.reshape(-1)
        if self.world_size == 1:
            if not np.shares_memory(out, send):  # in place there is nothing to do
                out[...] = send.reshape(-1)
            return self._check()
        sends = self._post(send, "reduce_scatter")
        self._sum_into([out], sends, lo, hi, shift=lo)
        self._done(recv, "reduce_scatter")

    def all_gather(self, send, recv, counts=None) -> None:
        offsets = rank_share_offsets(recv.size, self.world_size, self.rank, counts, send.size, "send")
        if self.world_size == 1:  # nothing to exchange, and no wait for the device (a captured step has none)
            out = recv.reshape(-1)
            if not np.shares_memory(out, send):
                out[...] = send.reshape(-1)
            return self._check()
        sends = self._post(send, "all_gather")
        out = recv.reshape(-1)
        for r, s in enumerate(sends):
            if r != self.rank or not np.shares_memory(s, out):  # in place: own share already there
                out[offsets[r]:offsets[r + 1]] = s
        self._done(recv, "all_gather")

    def broadcast(self, buf, root: int = 0) -> None:
        bufs = self._post(buf, "broadcast")
        if self.rank != root:
            buf.reshape(-1)[...] = bufs[root]
        self._done(buf, "broadcast")

    def barrier(self) -> None:
        if self.world_size > 1:
            self._wait("barrier")
        self._check()

    def abort(self, reason: str) -> None:
        self.group.abort(reason)

    # ---------------------------------------------------------------- groups
    def split(self, color: int, key: int | None = None) -> "LocalCommunicator":
        """Collective: the ranks that pass the same color form a new group, ranked by (key, rank)."""
        check_split(color, key)
        group = self.group
        group._posted[self.rank] = (color, self.rank if key is None else key)
        self._wait("split")
        if self.rank == 0:  # one rank makes the groups, so every member holds the same objects
            group._split = {}
            for members in split_members(group._posted).values():
                sub = LocalGroup(len(members), group.timeout_s, parent=group)
                sub.job_ranks = [group.job(r) for r in members]
                group._split.update({r: (sub, new) for new, r in enumerate(members)})
        self._wait("split")
        sub, new_rank = group._split[self.rank]
        self._wait("split")  # every rank has read its group before the next collective posts again
        return sub.communicator(new_rank)

    # ---------------------------------------------------------------- point-to-point
    def send(self, buf, peer: int) -> None:
        """Post a copy of buf for peer and return (thread ranks buffer a plain send)."""
        self._post_message(_Message(buf.reshape(-1).copy()), buf, peer)

    def _post_message(self, message: "_Message", buf, peer: int) -> None:
        check_peer(self, peer)
        self._check()
        _sync_device(buf)
        group = self.group
        with group._mail_ready:
            group._mail.setdefault((self.rank, peer), []).append(message)
            group._mail_ready.notify_all()

    def recv(self, buf, peer: int) -> None:
        """buf = the oldest message from peer not yet received; waits for it at most the timeout."""
        check_peer(self, peer)
        group, out = self.group, buf.reshape(-1)
        with group._mail_ready:
            box = group._mail.setdefault((peer, self.rank), [])
            arrived = group._mail_ready.wait_for(lambda: box or group.abort_reason is not None, group.timeout_s)
            self._check()
            if not arrived:
                group.abort(f"rank {group.job(self.rank)} waited more than {group.timeout_s:g} s for a message "
                            f"from rank {group.job(peer)}: the peer is stuck, dead or never sends it")
                self._check()
            message = box.pop(0)
        data = message.data
        if data.size != out.size or data.dtype != out.dtype:
            group.abort(f"rank {group.job(peer)} sent {data.size} {data.dtype} elements where rank "
                        f"{group.job(self.rank)} "
                        f"receives {out.size} {out.dtype}: the ranks disagree on the message")
            self._check()
        out[...] = data
        _sync_device(buf)
        with group._mail_ready:  # a sendrecv's sender may now reuse its buffer
            message.taken = True
            group._mail_ready.notify_all()

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        """send to dest and receive from source, neither waiting on the other (a ring step). The message
        is send itself, not a copy: the receiver copies it once, and this returns when it has."""
        message = _Message(send.reshape(-1))
        self._post_message(message, send, dest)
        self.recv(recv, source)
        group = self.group
        with group._mail_ready:
            taken = group._mail_ready.wait_for(lambda: message.taken or group.abort_reason is not None,
                                               group.timeout_s)
            self._check()
            if not taken:
                group.abort(f"rank {group.job(self.rank)} waited more than {group.timeout_s:g} s for rank "
                            f"{group.job(dest)} to receive "
                            "its message: the peer is stuck, dead or never receives it")
                self._check()

    def _check(self) -> None:
        if self.group.abort_reason is not None:
            raise CommAborted(f"aborted: {self.group.abort_reason}")

