"""A communicator over plain TCP sockets for CPU processes without MPI (torchrun or srun on CPUs).

It is the simplest correct thing, a star: every process sends its buffer to rank 0 over the connection
the rendezvous left open, rank 0 sums them in rank order 0, 1, ..., world-1 and sends the sum back. So
every rank gets identical bits, and the same bits as the thread and MPI communicators give for the same
world. Rank 0 moves 2(world-1) buffers per all-reduce: a reference for tests and small CPU jobs, not a
fast path (MPI and NCCL are those).

Every message starts with (operation, sequence number, byte count), so processes that call different
collectives, or the same one with different sizes, fail with a line that says so instead of mixing data.
A peer that dies closes its socket: the others see it at once (a rank waiting for one peer looks at the
world's other connections too, `_await_message`); a stuck one is caught by the timeout. So a process
that closes its connections while others still exchange messages is taken for dead: a job ends with a
collective of the whole world before any process closes.

Point-to-point needs a connection between any two ranks, not only to rank 0: `connect_all` (collective,
run once by open_world) and `split` make one. Every rank listens on a fresh port, the addresses (and a
random token from rank 0, which each new connection must present) go round through the star, and each
rank connects to the lower ranks and accepts the higher ones. A group made by split is a star around its
own rank 0 over those connections, so its collectives never share a socket with another communicator's.
A point-to-point message carries its own count per pair of ranks instead of the collective's sequence
number. An abort closes the sockets of every communicator split from the same world.
"""

import array
import fcntl
import os
import select
import socket
import struct
import termios
import time

import numpy as np

from . import CommAborted, check_peer, check_split, rank_share_offsets, send_while_receiving, split_members
from .rendezvous import close_all

_HEADER = struct.Struct("!BIQ")  # operation, sequence number, payload bytes
_OPS = {1: "all_reduce", 2: "all_gather", 3: "broadcast", 4: "barrier", 5: "send"}
_ADDRESS = 64  # bytes of a listening address in the exchange: host (utf-8, zero padded) then port
_HELLO = struct.Struct("!I16s")  # a new connection's first bytes: the connecting rank, the token
PROBE_S = 0.2  # while waiting for a message, how often the other connections are checked for a dead peer
_CODE = {name: code for code, name in _OPS.items()} | {"recv": 5}  # a send's message, as its receiver names it


class TcpCommunicator:
    # a split's ranks as the world it was split from numbers them, by rank in the split; None: the world's own.
    # Failure lines name world ranks, as their "rank N stopped:" prefix does
    job_ranks: list[int] | None = None

    def _job(self, rank: int) -> int:
        return rank if self.job_ranks is None else self.job_ranks[rank]

    def __init__(self, rank: int, world_size: int, peers: list, timeout_s: float = 300.0):
        """peers: the connection to each rank by index (None for itself), or, outside rank 0, [conn to rank 0]."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        if rank != 0 and len(peers) == 1:
            peers = [peers[0]] + [None] * (world_size - 1)
        self.peers = peers
        self._family = [self]  # every communicator split from the same world (shared list)
        self._sent = [0] * world_size  # point-to-point messages sent to / received from each rank
        self._received = [0] * world_size
        for s in peers:
            if s is not None:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(timeout_s)
        self.seq = 0
        self.abort_reason: str | None = None

    # ---------------------------------------------------------------- wire
    def _conn(self, peer: int):
        return self.peers[peer]

    def _fail(self, what: str, peer: int, err: BaseException, world_rank: bool = False) -> CommAborted:
        """Abort for a failure with `peer` (this communicator's rank, or the world's where `world_rank`)."""
        if self.abort_reason is not None:
            return CommAborted(f"{what} aborted: {self.abort_reason}")
        if isinstance(err, TimeoutError):
            reason = (f"rank {self._job(self.rank)} waited more than {self.timeout_s:g} s for rank {self._job(peer)} "
                      f"in {what}: a peer process is stuck or dead")
        else:
            who = peer if world_rank else self._job(peer)
            reason = f"the connection to rank {who} broke in {what} ({err}): its process exited or was killed"
        self.abort(reason)
        return CommAborted(f"{what} aborted: {reason}")

    def _send(self, peer: int, what: str, data, seq: int | None = None) -> None:
        payload = memoryview(np.ascontiguousarray(data)).cast("B") if data is not None else b""
        try:
            self._conn(peer).sendall(_HEADER.pack(_CODE[what], self.seq if seq is None else seq, len(payload)))
            if len(payload):
                self._conn(peer).sendall(payload)
        except OSError as e:
            raise self._fail(what, peer, e) from None

    def _recv(self, peer: int, what: str, out, seq: int | None = None) -> None:
        """Receive the peer's message for this collective (or point-to-point message number seq) into
        `out` (a contiguous array, or None)."""
        conn = self._conn(peer)
        view = memoryview(out).cast("B") if out is not None else memoryview(bytearray(0))
        seq = self.seq if seq is None else seq
        try:
            self._await_message(conn, peer, what)
            header = _recv_into(conn, bytearray(_HEADER.size))
            op, got_seq, nbytes = _HEADER.unpack(header)
            if (op, got_seq) != (_CODE[what], seq):
                reason = (f"rank {self._job(peer)} is in {_OPS.get(op, op)} #{got_seq} while rank "
                          f"{self._job(self.rank)} is in {what} "
                          f"#{seq}: the processes call collectives in different orders")
            elif nbytes != len(view):
                reason = (f"rank {self._job(peer)} sent {nbytes} bytes in {what} where rank {self._job(self.rank)} "
                          f"expects {len(view)}: "
                          "the processes disagree on the buffer size")
            else:
                _recv_into(conn, view)
                return
        except OSError as e:
            raise self._fail(what, peer, e) from None
        self.abort(reason)
        raise CommAborted(f"{what} aborted: {reason}")

    def _await_message(self, conn, peer: int, what: str) -> None:
        """Wait until conn has bytes to read, looking every PROBE_S at the world's other connections: a
        process that died is seen at once, also while this rank waits on another one that is alive (rank 0's
        star reading rank 1 while rank 2 is gone, or a group waiting on a rank that waits on the dead)."""
        deadline = time.monotonic() + self.timeout_s
        while not select.select([conn], [], [], PROBE_S)[0]:
            dead = _closed_peer(self._family[0].peers)
            if dead is not None:
                raise self._fail(what, dead, ConnectionError("connection closed"), world_rank=True)
            if time.monotonic() > deadline:
                raise self._fail(what, peer, TimeoutError())

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

    # ---------------------------------------------------------------- groups
    def connect_all(self) -> None:
        """Collective: connect every pair of ranks, so any two can exchange point-to-point messages."""
        self.peers = self._links(list(range(self.world_size)), self._exchange_addresses(0, self.rank))[1]

    def split(self, color: int, key: int | None = None) -> "TcpCommunicator":
        check_split(color, key)
        key = self.rank if key is None else key
        return self._links(None, self._exchange_addresses(color, key))[0]

    def _exchange_addresses(self, color: int, key: int):
        """Collective: open a listener; return it, every rank's (color, key, address) and rank 0's token."""
        self._begin("split")
        # listen where this process already reaches the others: the address of its connections
        local = next((c.getsockname()[0] for c in self.peers if c is not None), "127.0.0.1")
        listener = socket.create_server((local, 0), backlog=self.world_size)
        host, port = listener.getsockname()[:2]
        mine = np.zeros(_ADDRESS + 16 + 16, np.uint8)
        encoded = host.encode()[:_ADDRESS - 2]
        mine[:len(encoded)] = np.frombuffer(encoded, np.uint8)
        mine[_ADDRESS - 2:_ADDRESS] = np.frombuffer(struct.pack("!H", port), np.uint8)
        mine[_ADDRESS:_ADDRESS + 16] = np.frombuffer(struct.pack("!qq", color, key), np.uint8)
        mine[_ADDRESS + 16:] = np.frombuffer(os.urandom(16), np.uint8)
        everyone = np.empty(mine.size * self.world_size, np.uint8)
        try:
            self.all_gather(mine, everyone)
        except BaseException:
            listener.close()
            raise
        records = everyone.reshape(self.world_size, -1)
        table = []
        for record in records:
            raw = record.tobytes()
            host, (port,) = raw[:_ADDRESS - 2].rstrip(b"\0").decode(), struct.unpack("!H", raw[_ADDRESS - 2:_ADDRESS])
            table.append((*struct.unpack("!qq", raw[_ADDRESS:_ADDRESS + 16]), (host, port)))
        return listener, table, records[0].tobytes()[_ADDRESS + 16:]

    def _links(self, members, exchanged):
        """Connect this rank to the other members of its group (all ranks of the same color when members
        is None); return the group's communicator and its connections by group rank."""
        listener, table, token = exchanged
        if members is None:
            members = split_members([(c, k) for c, k, _ in table])[table[self.rank][0]]
        me = members.index(self.rank)
        links = [None] * len(members)
        try:
            listener.settimeout(self.timeout_s)
            for lower in range(me):  # connect to the lower ranks (their backlog holds us until they accept)
                conn = socket.create_connection(table[members[lower]][2], timeout=self.timeout_s)
                conn.sendall(_HELLO.pack(me, token))
                links[lower] = conn
            for _ in range(len(members) - 1 - me):  # accept the higher ones
                conn, _ = listener.accept()
                conn.settimeout(self.timeout_s)
                who, presented = _HELLO.unpack(bytes(_recv_into(conn, bytearray(_HELLO.size))))
                if presented != token or not me < who < len(members) or links[who] is not None:
                    conn.close()
                    raise ConnectionError("a connection that is not a rank of this group")
                links[who] = conn
        except OSError as e:
            close_all(links)
            raise self._fail("split", members[0], e) from None
        finally:
            listener.close()
        group = TcpCommunicator(me, len(members), links, self.timeout_s)
        group.job_ranks = [self._job(member) for member in members]
        group._family = self._family
        self._family.append(group)
        return group, links

    # ---------------------------------------------------------------- point-to-point
    def send(self, buf, peer: int) -> None:
        check_peer(self, peer)
        self._begin_p2p("send", peer)
        self._sent[peer] += 1
        self._send(peer, "send", _flat(buf), seq=self._sent[peer])

    def recv(self, buf, peer: int) -> None:
        check_peer(self, peer)
        self._begin_p2p("recv", peer)
        self._received[peer] += 1
        self._recv(peer, "recv", _flat(buf), seq=self._received[peer])

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        """The send runs on a second thread while this one receives: two ranks sending each other a
        buffer larger than the sockets' buffers would otherwise both wait in sendall."""
        send_while_receiving(lambda: self.send(send, dest), lambda: self.recv(recv, source), f"tcp-send-{self.rank}")

    def _begin_p2p(self, what: str, peer: int) -> None:
        if self.abort_reason is not None:
            raise CommAborted(f"{what} aborted: {self.abort_reason}")
        if self.peers[peer] is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer}: call connect_all first")

    def abort(self, reason: str) -> None:
        """Close every connection of every communicator split from the same world: the peers' pending and
        next messages fail at once."""
        for comm in list(self._family):
            if comm.abort_reason is None:
                comm.abort_reason = reason
            close_all(comm.peers)

    def close(self) -> None:
        for comm in list(self._family):
            close_all(comm.peers)


def _flat(buf):
    if not buf.flags.c_contiguous:
        raise ValueError("communicator buffers must be contiguous")
    return buf.reshape(-1)


def _closed_peer(peers) -> int | None:
    """The index of a connection whose peer has closed it (and nothing left to read), or None."""
    for index, sock in enumerate(peers):
        if sock is None:
            continue
        try:
            if _peer_closed(sock):
                return index
        except (OSError, ValueError):  # reset, or closed here meanwhile
            return index
    return None


def _peer_closed(sock) -> bool:
    """Whether the peer closed its end of sock, with no bytes of it left unread. Another thread of this process
    (a group's, the gradient sync's) may read sock at the same time: on Linux the kernel is asked (POLLRDHUP)
    without reading; elsewhere a peek, which can wait out the socket's timeout if that thread took the bytes that
    made sock readable between the select and the peek."""
    if hasattr(select, "POLLRDHUP"):
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP)
        events = sum(event for _, event in poller.poll(0))
        if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
            return True
        if not events & select.POLLRDHUP:
            return False
        unread = array.array("i", [0])  # the peer's last bytes may still wait here: then it has not gone yet
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, unread, True)
        return unread[0] == 0
    return bool(select.select([sock], [], [], 0)[0]) and not sock.recv(1, socket.MSG_PEEK)


def _recv_into(conn, view):
    view = memoryview(view)
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed")
        got += n
    return view
