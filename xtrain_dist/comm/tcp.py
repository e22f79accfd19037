"""A communicator over plain TCP sockets for CPU processes without MPI (torchrun or srun on CPUs).

It is the simplest correct thing, a star: every process sends its buffer to rank 0 over the connection
the rendezvous left open, rank 0 sums them in rank order 0, 1, ..., world-1 and sends the sum back. So
every rank gets identical bits, and the same bits as the thread and MPI communicators give for the same
world. Rank 0 moves 2(world-1) buffers per all-reduce: a reference for tests and small CPU jobs, not a
fast path (MPI and NCCL are those).

Every message starts with (operation, sequence number, byte count), so processes that call different
collectives, or the same one with different sizes, fail with a line that says so instead of mixing data.
A peer that dies closes its socket: the others see it at once; a stuck one is caught by the timeout.
"""

import socket
import struct

import numpy as np

from . import CommAborted, rank_share_offsets
from .rendezvous import close_all

_HEADER = struct.Struct("!BIQ")  # operation, sequence number, payload bytes
_OPS = {1: "all_reduce", 2: "all_gather", 3: "broadcast", 4: "barrier"}
_CODE = {name: code for code, name in _OPS.items()}


class TcpCommunicator:
    def __init__(self, rank: int, world_size: int, peers: list, timeout_s: float = 300.0):
        """peers: on rank 0, the connection to each rank by index (index 0 unused); elsewhere [conn to rank 0]."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.peers = peers
        for s in peers:
            if s is not None:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(timeout_s)
        self.seq = 0
        self.abort_reason: str | None = None

    # ---------------------------------------------------------------- wire
    def _conn(self, peer: int):
        return self.peers[peer] if self.rank == 0 else self.peers[0]

    def _fail(self, what: str, peer: int, err: BaseException) -> CommAborted:
        if self.abort_reason is not None:
            return CommAborted(f"{what} aborted: {self.abort_reason}")
        if isinstance(err, TimeoutError):
            reason = (f"rank {self.rank} waited more than {self.timeout_s:g} s for rank {peer} in {what}: "
                      "a peer process is stuck or dead")
        else:
            reason = f"the connection to rank {peer} broke in {what} ({err}): its process exited or was killed"
        self.abort(reason)
        return CommAborted(f"{what} aborted: {reason}")

    def _send(self, peer: int, what: str, data) -> None:
        payload = memoryview(np.ascontiguousarray(data)).cast("B") if data is not None else b""
        try:
            self._conn(peer).sendall(_HEADER.pack(_CODE[what], self.seq, len(payload)))
            if len(payload):
                self._conn(peer).sendall(payload)
        except OSError as e:
            raise self._fail(what, peer, e) from None

    def _recv(self, peer: int, what: str, out) -> None:
        """Receive the peer's message for this collective into `out` (a contiguous array, or None)."""
        conn = self._conn(peer)
        view = memoryview(out).cast("B") if out is not None else memoryview(bytearray(0))
        try:
            header = _recv_into(conn, bytearray(_HEADER.size))
            op, seq, nbytes = _HEADER.unpack(header)
            if (op, seq) != (_CODE[what], self.seq):
                reason = (f"rank {peer} is in {_OPS.get(op, op)} #{seq} while rank {self.rank} is in {what} "
                          f"#{self.seq}: the processes call collectives in different orders")
            elif nbytes != len(view):
                reason = (f"rank {peer} sent {nbytes} bytes in {what} where rank {self.rank} expects {len(view)}: "
                          "the processes disagree on the buffer size")
            else:
                _recv_into(conn, view)
                return
        except OSError as e:
            raise self._fail(what, peer, e) from None
        self.abort(reason)
        raise CommAborted(f"{what} aborted: {reason}")

    def _begin(self, what: str) -> None:
        if self.abort_reason is not None:
            raise CommAborted(f"{what} aborted: {self.abort_reason}")
        self.seq += 1

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, buf) -> None:
        self._begin("all_reduce")
        if self.world_size == 1:
            return
        flat = _flat(buf)
        if self.rank == 0:
            incoming = np.empty_like(flat)
            for peer in range(1, self.world_size):  # rank order: ((b0 + b1) + b2) + ...
                self._recv(peer, "all_reduce", incoming)
                flat += incoming
            for peer in range(1, self.world_size):
                self._send(peer, "all_reduce", flat)
        else:
            self._send(0, "all_reduce", flat)
            self._recv(0, "all_reduce", flat)

    def reduce_scatter(self, send, recv, counts=None) -> None:
        """One all-reduce of a copy, then this rank's share (send itself is left as it was)."""
        offsets = rank_share_offsets(send.size, self.world_size, self.rank, counts, recv.size, "recv")
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        total = _flat(send).copy()
        self.all_reduce(total)
        _flat(recv)[...] = total[lo:hi]

    def all_gather(self, send, recv, counts=None) -> None:
        out = _flat(recv)
        offsets = rank_share_offsets(out.size, self.world_size, self.rank, counts, send.size, "send")
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        self._begin("all_gather")
        out[lo:hi] = send.reshape(-1)  # a no-op when send is recv's own share
        if self.world_size == 1:
            return
        if self.rank == 0:
            for peer in range(1, self.world_size):
                self._recv(peer, "all_gather", out[offsets[peer]:offsets[peer + 1]])
            for peer in range(1, self.world_size):
                self._send(peer, "all_gather", out)
        else:
            self._send(0, "all_gather", out[lo:hi])
            self._recv(0, "all_gather", out)

    def broadcast(self, buf, root: int = 0) -> None:
        self._begin("broadcast")
        if self.world_size == 1:
            return
        flat = _flat(buf)
        if self.rank == 0:
            if root != 0:
                self._recv(root, "broadcast", flat)
            for peer in range(1, self.world_size):
                if peer != root:
                    self._send(peer, "broadcast", flat)
        elif self.rank == root:
            self._send(0, "broadcast", flat)
        else:
            self._recv(0, "broadcast", flat)

    def barrier(self) -> None:
        self._begin("barrier")
        if self.world_size == 1:
            return
        if self.rank == 0:
            for peer in range(1, self.world_size):
                self._recv(peer, "barrier", None)
            for peer in range(1, self.world_size):
                self._send(peer, "barrier", None)
        else:
            self._send(0, "barrier", None)
            self._recv(0, "barrier", None)

    def abort(self, reason: str) -> None:
        """Close every connection: the peers' pending and next messages fail at once."""
        if self.abort_reason is None:
            self.abort_reason = reason
        close_all(self.peers)

    def close(self) -> None:
        close_all(self.peers)


def _flat(buf):
    if not buf.flags.c_contiguous:
        raise ValueError("communicator buffers must be contiguous")
    return buf.reshape(-1)


def _recv_into(conn, view):
    view = memoryview(view)
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed")
        got += n
    return view
