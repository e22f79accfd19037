"""Starting ranks: one thread per rank in this process, each running the same function.

Failure is collective: when a rank raises, the group is aborted, so every rank blocked in (or later
entering) a collective raises CommAborted instead of waiting forever, and the launcher re-raises the
first real error as RankFailed.
"""

import threading
import time

from ..comm import CommAborted
from ..comm.local import LocalGroup


class RankFailed(Exception):
    """A rank raised; `error` is the original exception."""

    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"rank {rank}: {error}")
        self.rank = rank
        self.error = error


def run_thread_ranks(world_size: int, rank_fn, timeout_s: float = 300.0, group: LocalGroup | None = None,
                     grace_s: float = 5.0):
    """Run rank_fn(rank, comm) on world_size threads with a LocalGroup communicator; return the results
    in rank order, or raise RankFailed with the lowest rank that failed for a reason of its own.

    After a failure the other ranks get grace_s to notice the abort; a rank stuck outside any
    collective (a hung kernel, an endless loop) is then left behind: the threads are daemons, so
    it cannot keep the process alive."""
    group = group or LocalGroup(world_size, timeout_s)
    results = [None] * world_size
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        try:
            results[rank] = rank_fn(rank, group.communicator(rank))
        except BaseException as e:  # a dying rank must release its peers whatever it died of
            with lock:
                failures.append((rank, e))
            group.abort(f"rank {rank} failed")

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    failed_at = None
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.05)  # in slices, so Ctrl-C reaches this thread
            if failures and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
    except KeyboardInterrupt:
        group.abort("interrupted")
        for t in threads:
            t.join(5.0)
        raise
    if failures:
        # the lowest rank that failed on its own (the others only saw the abort): when every rank fails
        # alike (a run that diverged), the line names the same rank on every run
        own = sorted(((r, e) for r, e in failures if not isinstance(e, CommAborted)), key=lambda f: f[0])
        rank, error = own[0] if own else failures[0]
        raise RankFailed(rank, error)
    return results
