"""A Communicator that clocks itself: how long a rank spends in communication, and how much of that
its compute thread actually waited for.

`comm_s` sums the time inside every collective, from any thread of the rank. `exposed_s` is the part
on the critical path: collectives called from the rank's own thread (the one that created the
wrapper), plus the time it reports with `waited()` while blocked on a collective that another thread
(ddp.BucketedGradSync's communication thread) runs. Communication hidden behind backward is in the
first and not in the second.
"""

import threading
import time


class TimedCommunicator:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self._owner = threading.get_ident()
        self._lock = threading.Lock()
        self.comm_s = 0.0
        self.exposed_s = 0.0
        self.calls = 0

    def take(self) -> tuple[float, float, int]:
        """(comm_s, exposed_s, calls) since the last take, and start counting afresh."""
        with self._lock:
            out = (self.comm_s, self.exposed_s, self.calls)
            self.comm_s = self.exposed_s = 0.0
            self.calls = 0
        return out

    def waited(self, seconds: float) -> None:
        """The rank's thread was blocked this long on communication run by another thread."""
        with self._lock:
            self.exposed_s += seconds

    def _timed(self, collective, *args) -> None:
        t0 = time.perf_counter()
        try:
            collective(*args)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.comm_s += dt
                self.calls += 1
                if threading.get_ident() == self._owner:
                    self.exposed_s += dt

    def all_reduce(self, buf) -> None:
        self._timed(self.comm.all_reduce, buf)

    def reduce_scatter(self, send, recv, counts=None) -> None:
        self._timed(self.comm.reduce_scatter, send, recv, counts)

    def all_gather(self, send, recv, counts=None) -> None:
        self._timed(self.comm.all_gather, send, recv, counts)

    def broadcast(self, buf, root: int = 0) -> None:
        self._timed(self.comm.broadcast, buf, root)

    def barrier(self) -> None:
        self._timed(self.comm.barrier)

    def abort(self, reason: str) -> None:
        self.comm.abort(reason)
