"""Stream order, checked: accesses to device memory that nothing orders between two CUDA streams.

On a GPU, work queued on two streams runs in any interleaving unless something orders it: stream order
within one stream, an event recorded on one and waited for by the other (`Stream.wait_event`), or the
host having seen the work finish (a stream's or an event's `synchronize`, a copy to the host) before it
queues the next. The simulator runs every operation when it is queued, so a missing order never changes
a result here. This module finds it anyway, the way ThreadSanitizer finds data races between threads,
with vector clocks, whatever order the operations happened to run in:

- Every stream numbers the operations queued on it. Its clock says, for every stream, how many of that
  stream's operations come before its next one: its own, those of the events it has waited for, and
  those the host had seen finish when the operation was queued.
- An event takes its stream's clock when it is recorded; `wait_event` merges that into the waiting
  stream's. The host's clock is what any host thread has seen finish: work queued after that, on any
  stream, by any thread, runs after it.
- Every operation names the bytes it reads and writes (a kernel: its pointer arguments, written where
  the parameter is not `const`; cuBLAS: A and B read, C written; NCCL: send read, receive written;
  array methods: inputs read, outputs written). One that conflicts with an earlier access of another
  stream (either of the two writes) that its clock does not cover is a stream race: `StreamRace`,
  naming both operations, raised before the operation runs.
- CuPy's memory pool gives a freed block to the next allocation on the stream that allocated it. An
  array dropped while another stream's access to it is not yet ordered before that stream would be
  overwritten under that access; reported at the next operation (the weakref callback that sees the
  drop cannot raise).

Only memory the simulator allocated is tracked (fake_cupy's arrays); host arrays and numpy temporaries
are not. An event's `done` is True at once on the simulator and orders nothing here: the CUDA
watchdog polls it from its own thread, and counting that as the host having seen the work finish would
hide every missing fence.
"""

from __future__ import annotations

import bisect
import threading
import weakref


class StreamRace(RuntimeError):
    pass


class Clocked:
    """What the checker keeps per stream (fake_cupy.Stream derives from it)."""

    def __init__(self, ptr: int, blocking: bool):
        self.ptr = ptr
        self.blocking = blocking
        self.clock: dict[int, int] = {ptr: 0}
        self.label = ("the null stream" if ptr == 0 else
                      f"stream {ptr:#x} (made by thread {threading.current_thread().name})")
        with _lock:
            _streams[ptr] = self


class _Access:
    __slots__ = ("epoch", "hi", "lo", "stream", "what", "write")

    def __init__(self, lo, hi, write, stream, epoch, what):
        self.lo, self.hi, self.write, self.stream, self.epoch, self.what = lo, hi, write, stream, epoch, what

    def before(self, clock: dict[int, int]) -> bool:
        return self.epoch <= clock.get(self.stream.ptr, 0)

    def within(self, lo: int, hi: int) -> bool:
        return lo <= self.lo and self.hi <= hi


class _Region:
    __slots__ = ("accesses", "end", "start", "stream")

    def __init__(self, start: int, end: int, stream: Clocked):
        self.start, self.end, self.stream = start, end, stream
        self.accesses: list[_Access] = []


_lock = threading.RLock()
_host: dict[int, int] = {}                       # work the host has seen finish
_streams: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # ptr -> stream
_starts: list[int] = []                          # sorted start addresses of the live regions
_regions: dict[int, _Region] = {}
_deferred: list[str] = []                        # use-after-free reports, raised at the next operation


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for ptr, n in other.items():
        if into.get(ptr, 0) < n:
            into[ptr] = n


def stream_at(ptr: int) -> Clocked | None:
    return _streams.get(int(ptr))


def _next_clock(stream: Clocked) -> dict[int, int]:
    """What the next operation queued on `stream` comes after: the stream's own clock, the work the host
    has seen finish, and the legacy null stream's order (it waits for every blocking stream, they for it)."""
    clock = dict(stream.clock)
    _merge(clock, _host)
    if stream.ptr == 0:
        for other in list(_streams.values()):
            if other.blocking:
                _merge(clock, other.clock)
    elif stream.blocking and 0 in _streams:
        _merge(clock, _streams[0].clock)
    return clock


# ---------------------------------------------------------------------------- memory

def allocated(start: int, nbytes: int, stream: Clocked) -> None:
    if nbytes <= 0:
        return
    with _lock:
        bisect.insort(_starts, start)
        _regions[start] = _Region(start, start + nbytes, stream)


def freed(start: int) -> None:
    """The allocation at start is gone; CuPy's pool would hand its block to `region.stream`'s next
    allocation, so every access of another stream must already be ordered before that stream."""
    with _lock:
        region = _regions.pop(start, None)
        if region is None:
            return
        del _starts[bisect.bisect_left(_starts, start)]
        known = _next_clock(region.stream)
        for a in region.accesses:
            if a.stream is not region.stream and not a.before(known):
                use = "write" if a.write else "read"
                _deferred.append(
                    f"cudasim: use after free: an array allocated on {region.stream.label} was freed while "
                    f"{a.what} on {a.stream.label} may still {use} it (nothing orders that {use} before "
                    f"{region.stream.label}, whose next allocation "
                    "may reuse the block): keep the array alive, or make its stream wait for an event recorded "
                    "after the access")
                return


def _region_at(address: int) -> _Region | None:
    i = bisect.bisect_right(_starts, address) - 1
    if i < 0:
        return None
    region = _regions[_starts[i]]
    return region if address < region.end else None


# ---------------------------------------------------------------------------- operations

def operation(stream: Clocked, what: str, accesses) -> None:
    """One operation queued on `stream`: `accesses` are (first byte, end byte, writes?) triples of
    device memory. Raises StreamRace if one conflicts with an access that nothing orders before it."""
    with _lock:
        if _deferred:
            raise StreamRace(_deferred.pop(0))
        clock = _next_clock(stream)
        clock[stream.ptr] = clock.get(stream.ptr, 0) + 1
        found = []
        for lo, hi, write in accesses:
            region = _region_at(lo)
            if region is None or hi <= lo:
                continue
            hi = min(hi, region.end)
            for a in region.accesses:
                if a.lo < hi and lo < a.hi and (write or a.write) and not a.before(clock):
                    raise StreamRace(
                        f"cudasim: stream race: {what} on {stream.label} {'writes' if write else 'reads'} bytes "
                        f"{lo - region.start}..{hi - region.start} of a {region.end - region.start}-byte "
                        f"allocation that {a.what} on {a.stream.label} {'wrote' if a.write else 'read'} "
                        f"(bytes {a.lo - region.start}..{a.hi - region.start}), and nothing orders the two: "
                        "record an event after the first and make the second's stream wait for it")
            found.append((region, _Access(lo, hi, write, stream, clock[stream.ptr], what)))
        stream.clock = clock
        for region, new in found:
            # an access the new one covers, ordered before it and no stronger, can race with nothing
            # the new one would not race with too: drop it, so a region keeps a handful of accesses
            region.accesses = [a for a in region.accesses
                               if not (a.within(new.lo, new.hi) and a.before(clock) and (new.write or not a.write))]
            region.accesses.append(new)


def recorded(stream: Clocked) -> dict[int, int]:
    """The clock an event recorded on `stream` now takes."""
    with _lock:
        return dict(stream.clock)


def wait(stream: Clocked, event_clock: dict[int, int]) -> None:
    with _lock:
        _merge(stream.clock, event_clock)


def host_saw(clock: dict[int, int]) -> None:
    """The host has seen the work of `clock` finish (a synchronize returned, a copy reached the host)."""
    with _lock:
        _merge(_host, clock)


def host_saw_all() -> None:
    with _lock:
        for stream in list(_streams.values()):
            _merge(_host, stream.clock)


def take_deferred() -> list[str]:
    """The use-after-free reports no operation has raised yet (a test's teardown asks for them)."""
    with _lock:
        reports, _deferred[:] = list(_deferred), []
        return reports
