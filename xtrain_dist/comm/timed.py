"""A Communicator that clocks itself: how long a rank spends in communication, and how much of that
its compute thread actually waited for.

`comm_s` sums the time inside every collective, from any thread of the rank. `exposed_s` is the part
on the critical path: collectives called from the rank's own thread (the one that created the
wrapper), plus the spans it reports with `waited()` while its work stood still for a collective that
another thread (ddp.BucketedGradSync's communication thread) runs. Communication hidden behind
backward is in the first and not in the second.

Part of what a rank waits for at the end of backward is not communication at all: a peer that is still
computing. Where the ranks share a host clock (thread ranks: comm/local.py's share_mark), the sync marks
when each rank's backward ended (`backward_done`) and `waited_for_peers` records the part of the rank's wait
before the slowest rank of its group got there: `peer_wait_s`, a part of exposed_s. exposed_s less it is
the communication no compute hid, on any rank; on a GPU, or across processes, it is not known (None).

The clock is the backend's: `timestamp()` marks where the calling thread's work has got to, and
`elapsed(start, end)` turns two marks into seconds. On the CPU a mark is the time now. On a GPU a
collective returns as soon as it is queued, so host time would measure only the queueing: the CUDA
backend's marks are timing events on the thread's stream, and a collective's span is what the GPU
spent between them, waiting for peers included. Marks are kept until `take()` (once a step, after the
step's one device-to-host read) turns them into seconds, so timing adds no synchronisation.
"""

import threading
import time

PEERS = "peers"  # a span's kind (the 4th field; True: exposed, False: hidden): waiting for a slower rank


class HostClock:
    """Wall time: for communicators whose calls return when the collective is done."""

    timestamp = staticmethod(time.perf_counter)

    @staticmethod
    def elapsed(start: float, end: float) -> float:
        return end - start


class TimedCommunicator:
    def __init__(self, comm, clock=HostClock, marks_of: "TimedCommunicator | None" = None, label: str = "dp"):
        """label: which group the collectives go over ("dp", the data-parallel group, the whole world without
        a mesh; "tp", "pp", "world"), for `payload`."""
        self.comm = comm
        self.label = label
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.clock = clock
        self._owner = threading.get_ident()
        self._lock = threading.Lock()
        # (start, end, in a collective, kind: exposed True, hidden False or PEERS, group label, payload bytes)
        self._spans: list[tuple[object, object, bool, bool | str, str, int]] = []
        self._marks_of = marks_of or self  # whose marks this one's collectives add to
        # called before each of this communicator's calls: at --tp/--pp on a GPU, the overlapped gradient sync's
        # settle (parallel/ddp.py), which keeps one order of collectives on every rank
        self.before = None
        # whether the ranks share a host clock: the communicator tells the peers' marks, and the clock's marks are
        # host times (not a GPU's events); known from the first backward_done
        self.knows_peers = False
        self._backwards = 0  # backward_done calls: the key of each step's mark, alike on every rank

    def timing(self, comm, label: str) -> "TimedCommunicator":
        """Another communicator of the rank (a group of its mesh) whose collectives are timed into this one's
        marks, so that one take() counts them all."""
        return TimedCommunicator(comm, self.clock, marks_of=self, label=label)

    def take(self) -> tuple[float, float, int]:
        """(comm_s, exposed_s, calls) since the last take, and start counting afresh."""
        return self.tally(self.detach())

    def detach(self) -> list:
        """The marks since the last take or detach, not yet turned into seconds (which waits for the GPU to
        pass them): the loop detaches a step's marks when it has queued the step and tallies them when it
        reads the step's loss, after queuing the next."""
        with self._lock:
            spans, self._spans = self._spans, []
        return spans

    @staticmethod
    def calls(spans: list) -> int:
        """How many collectives detached marks hold, without timing them."""
        return sum(span[2] for span in spans)

    @staticmethod
    def payload(spans: list) -> dict[str, int]:
        """The bytes this rank handed to collectives in detached marks, by group label: an all-reduce's or a
        broadcast's buffer, a reduce-scatter's input, an all-gather's own share, what a send or a sendrecv
        sends. What goes over the wire
        depends on the algorithm (a ring all-reduce sends 2 (n - 1) / n of its buffer); this is the size the
        textbook counts are written in."""
        total: dict[str, int] = {}
        for _start, _end, collective, _kind, label, nbytes in spans:
            if collective:
                total[label] = total.get(label, 0) + nbytes
        return total

    def tally(self, spans: list) -> tuple[float, float, int]:
        """(comm_s, exposed_s, calls) of detached marks."""
        return (*self.totals(self.tally_groups(spans)), self.calls(spans))

    def tally_groups(self, spans: list) -> dict[str, list[float]]:
        """{group label: [comm_s, exposed_s, peer_wait_s]} of detached marks: `tally` by group, so that the
        data-parallel sync's hidden share can be read beside a mesh's tensor-parallel and pipeline collectives
        (which the rank's thread runs itself, all of them exposed). Each span is turned into seconds once (on a
        GPU, a read of two events)."""
        groups: dict[str, list[float]] = {}
        for start, end, collective, kind, label, _nbytes in spans:
            seconds = max(0.0, self.clock.elapsed(start, end))
            group = groups.setdefault(label, [0.0, 0.0, 0.0])
            group[0] += seconds if collective else 0.0
            group[1] += seconds if kind is True else 0.0  # exposed
            group[2] += seconds if kind == PEERS else 0.0
        return groups

    @staticmethod
    def totals(groups: dict[str, list[float]]) -> tuple[float, float]:
        """(comm_s, exposed_s) over every group of tally_groups."""
        return sum(g[0] for g in groups.values()), sum(g[1] for g in groups.values())

    @staticmethod
    def peer_wait(groups: dict[str, list[float]]) -> float:
        """peer_wait_s over every group of tally_groups."""
        return sum(g[2] for g in groups.values())

    def waited(self, start, end) -> None:
        """The rank's work stood still from one clock mark to the other, for communication run by another
        thread."""
        owner = self._marks_of
        with owner._lock:
            owner._spans.append((start, end, False, True, self.label, 0))

    def backward_done(self):
        """A clock mark, at the end of a step's backward, taken by a gradient sync before it hands over its last
        piece (at backward's last announcement or in finish()); with knows_peers, shared with the group's ranks
        for waited_for_peers."""
        t = self.clock.timestamp()
        self._backwards += 1
        self.knows_peers = isinstance(t, float) and hasattr(self.comm, "share_mark")
        if self.knows_peers:
            self.comm.share_mark(self._backwards, t)
        return t

    def waited_for_peers(self, start, end) -> None:
        """The rank's sync ran from `start` (its backward_done) to `end`: record the part of it before the slowest
        rank of the group ended its backward, time the rank waited for a peer's compute rather than for
        communication (a part of what waited() or the rank's own collectives recorded as exposed)."""
        latest = self.comm.slowest_mark(self._backwards) if self.knows_peers else None
        if latest is not None and latest > start:
            owner = self._marks_of
            with owner._lock:
                owner._spans.append((start, min(latest, end), False, PEERS, self.label, 0))

    def _timed(self, nbytes: int, collective, *args) -> None:
        if self.before is not None:
            self.before()
        start = self.clock.timestamp()
        try:
            collective(*args)
        finally:
            end = self.clock.timestamp()
            owner = self._marks_of
            with owner._lock:
                owner._spans.append((start, end, True, threading.get_ident() == self._owner, self.label, nbytes))

    def all_reduce(self, buf) -> None:
        self._timed(buf.nbytes, self.comm.all_reduce, buf)

    def reduce_scatter(self, send, recv, counts=None) -> None:
        self._timed(send.nbytes, self.comm.reduce_scatter, send, recv, counts)

    def all_gather(self, send, recv, counts=None) -> None:
        self._timed(send.nbytes, self.comm.all_gather, send, recv, counts)

    def broadcast(self, buf, root: int = 0) -> None:
        self._timed(buf.nbytes, self.comm.broadcast, buf, root)

    def barrier(self) -> None:
        self._timed(0, self.comm.barrier)

    # point-to-point: the payload counted is what this rank sends
    def send(self, buf, peer: int) -> None:
        self._timed(buf.nbytes, self.comm.send, buf, peer)

    def recv(self, buf, peer: int) -> None:
        self._timed(0, self.comm.recv, buf, peer)

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        self._timed(send.nbytes, self.comm.sendrecv, send, dest, recv, source)

    def abort(self, reason: str) -> None:
        self.comm.abort(reason)
