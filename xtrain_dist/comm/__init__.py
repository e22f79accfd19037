"""Communicators: the collectives data parallelism needs, behind one protocol.

Implementations: `local` (ranks are threads of this process; numpy or CuPy buffers), and, for
several processes, `mpi` (host buffers, mpi4py), `tcp` (host buffers, sockets to rank 0), `nccl` (GPU
buffers, nccl4py) and `hybrid` (rank threads inside processes); `world.open_world` picks and joins one.
Every collective is in place or into a caller's buffer, a sum where it reduces, and gives every rank
the same bits. All but NCCL return when the result is in place; NCCL's are enqueued on the rank's
stream (stream order makes them visible) and `synchronize()` waits for them on the host.
"""

from typing import Protocol


class CommAborted(RuntimeError):
    """Raised in a rank whose collective was cut short because another rank failed or timed out."""


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, buf) -> None:
        """buf = sum of every rank's buf, in place."""

    def broadcast(self, buf, root: int = 0) -> None:
        """buf = root's buf, in place."""

    def all_gather(self, send, recv) -> None:
        """recv[r*n:(r+1)*n] = rank r's send, for n = send.size and every r."""

    def reduce_scatter(self, send, recv) -> None:
        """recv = sum over ranks of send[rank*n:(rank+1)*n], for n = recv.size."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def abort(self, reason: str) -> None:
        """Make every rank's pending and future collectives raise CommAborted (called on failure)."""
