"""The textbook ring all-reduce, written over send/recv (`--all-reduce ring`).

The buffer is cut into world chunks, as evenly as its size allows (comm/local.py's _chunk: the first
n % world chunks one element longer). Ranks stand in a ring: each sends to rank + 1 and receives from
rank - 1. With N ranks and chunk c starting on rank c:

    reduce-scatter, steps s = 0 .. N-2: send chunk (rank - s) % N, receive chunk (rank - s - 1) % N and
        add it into that chunk of our buffer. Chunk c travels c -> c+1 -> ... -> c+N-1 and is summed
        in that order, ((x_c + x_{c+1}) + x_{c+2}) + ...; after N-1 steps rank r holds chunk (r+1) % N whole.
    all-gather, steps s = 0 .. N-2: send chunk (rank + 1 - s) % N, receive chunk (rank - s) % N and
        copy it over ours. The sums are copied, never added again, so every rank ends with the same bits.

Each rank sends 2(N-1) chunks, 2(N-1)/N of the buffer: the bus bandwidth of an all-reduce is
size x 2(N-1)/N / time. The sum order differs from the library all-reduce's rank order (0, 1, ...), so
the two agree within float32 rounding, not bit for bit.
"""

import contextlib

import numpy as np

from .local import _chunk

ALL_REDUCES = ("library", "ring")  # --all-reduce: the communicator's own all-reduce, or this ring


def ring_chunks(n: int, world: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of the world chunks of an n-element buffer."""
    return [_chunk(n, world, c) for c in range(world)]


def ring_all_reduce(comm, buf, scratch=None) -> None:
    """buf = the sum over comm's ranks, in place, by the ring; scratch: a flat buffer of at least the
    largest chunk (made here if None)."""
    world, rank = comm.world_size, comm.rank
    if world == 1:
        return
    flat = buf.reshape(-1)
    chunks = ring_chunks(flat.size, world)
    longest = chunks[0][1] - chunks[0][0]
    if scratch is None or scratch.size < longest or scratch.dtype != flat.dtype:
        scratch = _empty_like(flat, longest)
    next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
    with _on_comm_stream(comm):
        for step in range(world - 1):  # reduce-scatter
            send_lo, send_hi = chunks[(rank - step) % world]
            recv_lo, recv_hi = chunks[(rank - step - 1) % world]
            incoming = scratch[:recv_hi - recv_lo]
            comm.sendrecv(flat[send_lo:send_hi], next_rank, incoming, prev_rank)
            flat[recv_lo:recv_hi] += incoming  # addition commutes bit for bit: this is incoming + ours
        for step in range(world - 1):  # all-gather
            send_lo, send_hi = chunks[(rank + 1 - step) % world]
            recv_lo, recv_hi = chunks[(rank - step) % world]
            comm.sendrecv(flat[send_lo:send_hi], next_rank, flat[recv_lo:recv_hi], prev_rank)


def _on_comm_stream(comm):
    """An NCCL communicator bound to a stream of its own: the additions go on that stream too, in order
    with the transfers (a CuPy stream is a context manager that makes it the current one)."""
    stream = getattr(comm, "stream", None)
    return stream if stream is not None else contextlib.nullcontext()


def _empty_like(flat, n: int):
    return np.empty_like(flat, shape=(n,))  # numpy or CuPy, as flat is


class RingAllReduce:
    """A communicator whose all_reduce is the ring; every other call goes to the communicator it wraps."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self._scratch = None

    def all_reduce(self, buf) -> None:
        longest = -(-buf.size // self.world_size)
        if self._scratch is None or self._scratch.size < longest or self._scratch.dtype != buf.dtype:
            self._scratch = _empty_like(buf.reshape(-1), longest)
        ring_all_reduce(self.comm, buf, self._scratch)

    def __getattr__(self, name):
        return getattr(self.comm, name)
