"""Rendezvous: every process of a job finds rank 0 over TCP and receives the same few bytes (NCCL's
unique id) from it; the connections it leaves open carry the TCP communicator's traffic.

Nothing unsafe crosses the socket: fixed-format messages (a magic, a version, fixed-size fields and one
length-prefixed body of at most 64 KiB; no pickle), and a shared token that never travels itself:

    rank 0 -> peer   MAGIC version server_nonce
    peer -> rank 0   MAGIC version kind rank world fingerprint peer_nonce mac len reason, where
                       kind=JOIN: mac = HMAC(token, "join" server_nonce rank world fingerprint peer_nonce), len 0
                       kind=FAIL: mac = HMAC(token, "fail" server_nonce rank world reason), fingerprint and
                                  peer_nonce zero, reason: at most 1 KiB of UTF-8
    rank 0 -> peer   MAGIC status=ACCEPT HMAC(token, "accept" peer_nonce body) len body    (body: the payload)
                  or MAGIC status=REFUSE 0*32 len reason

Rank 0 checks the peer's HMAC with hmac.compare_digest, the peer checks rank 0's, so neither side accepts
bytes from a process that does not hold the token. `fingerprint` is a digest of the run's configuration:
a process started with a different command line is refused with a line that says so. A process that holds
the token but cannot join (another command line, another world size) ends the job at once: rank 0 tells
every rank why and raises, instead of waiting out the timeout for a rank that will never come. A stranger
without the token is only refused: it may belong to another job.

Rank 0 answers ACCEPT once every rank has joined, so no process leaves the rendezvous before all can.
A process that fails before it joins (a missing file on its node) says so instead, so that nobody waits
out the timeout for it: a peer sends a FAIL (`report_failure`); rank 0 then answers every joined and
joining rank with REFUSE "process k failed: reason" and raises. A rank 0 that fails before it serves
answers every joiner with REFUSE "process 0 failed: reason" (`RendezvousServer.refuse_all`), and so does
one that fails while it serves, whatever the failure (`RendezvousServer._abandon`).

Rank 0 hears every connection at once (one selector loop): it greets each as it is accepted and reads
its message as the bytes come, drops one that has not sent it whole within GREETING_TIMEOUT_S, and holds
at most MAX_PENDING such connections, so strangers (a port scanner, a flood, a sender of garbage or of a
forged JOIN) cannot keep a rank out. Each refused connection is logged by its address, at most one line
per host every LOG_EVERY_S, the rest counted.

Rank 0 binds only the address it is told (`bind`); the others connect to the address they are told
(`advertise`). The two differ behind docker or NAT: inside a container rank 0 binds the container's
address (or 0.0.0.0) while the others connect to the host's address and a published port.
"""

import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import NamedTuple

from ..errors import XtrainError
from .launch_env import Launch

MAGIC = b"XTRZ"
VERSION = 2
MAX_BODY = 64 * 1024
MAX_REASON = 1024                                 # bytes of a FAIL's reason
ACCEPT, REFUSE = 0, 1                             # rank 0's answer
JOIN, FAIL = 0, 1                                 # the peer's message
TOKEN_ENV = "XTRAIN_RDZV_TOKEN"

_GREETING = struct.Struct("!4sH32s")              # magic, version, server nonce
_JOIN = struct.Struct("!4sHBII32s32s32sH")       # magic, version, kind, rank, world, fingerprint, peer nonce,
                                                  # mac, reason length (then the reason)
_REPLY = struct.Struct("!4sB32sI")                # magic, status, mac, body length
HANDSHAKE_TIMEOUT_S = 10.0                        # a peer's wait for each of rank 0's messages but the last
# rank 0's wait for a new connection's whole message, from its accept: a rank sends it at once, and a
# connection that says nothing (a port scanner, a half-open socket, a sender of one byte a second) must not
# hold a place for long
GREETING_TIMEOUT_S = 2.0
MAX_PENDING = 64                                  # connections rank 0 has greeted and not yet heard
LOG_EVERY_S = 10.0                                # at most one line per refused host in this time
MAX_HOSTS_NAMED = 5                               # hosts a timeout's line names among those refused
LINGER_S = 15.0                                   # how long rank 0 tells late joiners of a failure
# what makes two processes' configurations differ, most likely first (--resume auto decides per process)
CONFIGURATION_HINT = ("(another command line, other corpus or tokenizer files, or --resume auto finding a "
                      "checkpoint in --save-dir on some machines only?)")


def parse_hostport(text: str, default_port: int | None, what: str) -> tuple[str, int]:
    """'host', 'host:port', '[v6addr]:port' -> (host, port)."""
    host, port = text, None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or rest[:1] not in ("", ":"):  # '[::1' and '[::1]junk' are typos, not ::1 on the default port
            raise XtrainError(f"{what} '{text}' is not HOST[:PORT]")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    if port is None and default_port is None:
        raise XtrainError(f"{what} '{text}' needs a port (HOST:PORT)")
    try:
        number = default_port if port is None else int(port)
    except ValueError:
        number = -1
    if not host or not 0 <= number < 65536:
        raise XtrainError(f"{what} '{text}' is not HOST[:PORT]")
    return host, number


def derived_token(job_id: str, host: str, port: int) -> bytes:
    """The token when XTRAIN_RDZV_TOKEN is unset: it keeps two jobs on one port apart (a stale or a
    neighbouring job is refused), but it is no secret: set XTRAIN_RDZV_TOKEN where others can connect."""
    return f"xtrain-dist {job_id} {host}:{port}".encode()


def token_from_env(default: bytes) -> bytes:
    value = os.environ.get(TOKEN_ENV)
    return value.encode() if value else default


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed by the other side")
        data += chunk
    return bytes(data)


def _one_line(text: str) -> str:
    """`text` as one line of at most MAX_REASON bytes of UTF-8."""
    return " ".join(text.split()).encode()[:MAX_REASON].decode(errors="ignore")


def _refuse(conn: socket.socket, reason: str) -> None:
    """Answer REFUSE `reason` and close (best effort: the peer may be gone)."""
    body = reason.encode()[:MAX_BODY]
    with contextlib.suppress(OSError):
        conn.sendall(_REPLY.pack(MAGIC, REFUSE, bytes(32), len(body)) + body)
    conn.close()


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return str(err) or type(err).__name__


def _refuse_joined(peers: list, reason: str) -> list[int]:
    """Answer every joined rank (an open connection in `peers`) with REFUSE `reason`, close it and clear its
    slot; returns those ranks."""
    joined = [r for r, p in enumerate(peers) if p is not None]
    for r in joined:
        _refuse(peers[r], reason)
        peers[r] = None
    return joined


class _Message(NamedTuple):
    """What a peer said: a JOIN (fingerprint, nonce) or a FAIL (reason)."""
    kind: int
    rank: int
    fingerprint: bytes
    nonce: bytes
    reason: str


class _Greeted:
    """A connection rank 0 has greeted and whose message it reads as the bytes come (the socket does not
    block): its nonce, what has arrived, how much the message holds, and when it must have arrived."""

    def __init__(self, conn: socket.socket, addr, nonce: bytes, deadline: float):
        self.conn, self.addr, self.nonce, self.deadline = conn, addr, nonce, deadline
        self.data = bytearray()
        self.size = _JOIN.size  # the fixed part; a FAIL's reason adds its length once the fixed part is read


class _Heard(NamedTuple):
    """A connection whose message has been read, or that gave up: `reason` says why it is refused (None: it
    fits this job), `of_this_job` whether it holds the token (see RendezvousServer._judge)."""
    conn: socket.socket
    addr: tuple
    msg: _Message | None
    reason: str | None
    of_this_job: bool


class _RefusalLog:
    """The refused connections, one log line each, but at most one line per host every LOG_EVERY_S: a
    stranger that connects again and again (a scanner, a flood) is counted, and the count is logged with its
    host's next line or at the end (`flush`)."""

    def __init__(self, log):
        self.log = log
        self.hosts: dict[str, list] = {}  # host -> [connections refused, not yet logged, last logged at, last]

    def refused(self, addr, reason: str) -> None:
        who = f"{addr[0]}:{addr[1]}"
        entry = self.hosts.setdefault(addr[0], [0, 0, -LOG_EVERY_S, ""])
        entry[0] += 1
        entry[3] = f"{who} ({reason})"
        now = time.monotonic()
        if now - entry[2] < LOG_EVERY_S:
            entry[1] += 1
            return
        more = f" (and {entry[1]} more from {addr[0]} since its last line)" if entry[1] else ""
        entry[1:3] = [0, now]
        self.log(f"rendezvous: refused a connection from {who}: {reason}{more}")

    def flush(self) -> None:
        for host, (_, unlogged, _, last) in self.hosts.items():
            if unlogged:
                self.log(f"rendezvous: refused {unlogged} more connection{'s' if unlogged > 1 else ''} from {host} "
                         f"(the last: {last})")
                self.hosts[host][1] = 0

    def summary(self) -> str:
        """Who was refused, in a few words per host: "HOST:PORT (why)", or for a host refused more than
        once "HOST (N connections, the last: HOST:PORT (why))"."""
        parts = [last if count == 1 else f"{host} ({count} connections, the last: {last})"
                 for host, (count, _, _, last) in self.hosts.items()]
        if len(parts) > MAX_HOSTS_NAMED:
            parts[MAX_HOSTS_NAMED:] = [f"{len(parts) - MAX_HOSTS_NAMED} more hosts"]
        return "; ".join(parts)


class RendezvousServer:
    """Rank 0's side. Listens as soon as it is made, so a port in use is an error at once.

    Every connection is greeted as it is accepted and read as its bytes arrive, all at once in one loop
    (a selector), so no connection waits for another's: one that has not sent its whole message within
    GREETING_TIMEOUT_S of its accept is dropped, and at most MAX_PENDING connections wait to be heard (one
    more drops the oldest of the host that holds most), so strangers that connect and say nothing, or
    nothing useful, cannot keep a rank out."""

    def __init__(self, bind: tuple[str, int], world: int, token: bytes, fingerprint: bytes = b"",
                 timeout_s: float = 300.0, log=print):
        self.world, self.token, self.timeout_s, self.log = world, token, timeout_s, log
        self.fingerprint = hashlib.sha256(fingerprint).digest()
        host, port = bind
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise XtrainError(f"rendezvous cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
        family, _, _, _, address = infos[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            self.sock.bind(address)
            self.sock.listen(max(128, world))  # a burst of connections waits in the kernel, not refused
        except OSError as e:
            self.sock.close()
            hint = {98: "another job or process uses that port; choose another with --rdzv-bind HOST:PORT "
                        "(and --rdzv-advertise for the other processes)",
                    99: "the address is not one of this machine's; behind docker or NAT bind the container's "
                        "address or 0.0.0.0 with --rdzv-bind and keep the address the others reach in "
                        "--rdzv-advertise"}.get(e.errno, "")
            raise XtrainError(f"rendezvous cannot listen on {host}:{port}: {_describe(e)}"
                              + (f" ({hint})" if hint else "")) from None
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.sock.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.pending: dict[socket.socket, _Greeted] = {}  # greeted, not yet heard
        self.refusals = _RefusalLog(log)

    def serve(self, payload: bytes = b"") -> list[socket.socket | None]:
        """Hand `payload` to ranks 1..world-1 once all have joined; return their connections by rank
        (index 0 is None). A FAIL from a rank ends it at once (see _abort)."""
        if len(payload) > MAX_BODY:
            raise ValueError("rendezvous payload too large")
        peers: list[socket.socket | None] = [None] * self.world
        nonces: list[bytes] = [b""] * self.world
        deadline = time.monotonic() + self.timeout_s
        try:
            heard = self._hear_all(deadline) if self.world > 1 else iter(())
            while sum(p is not None for p in peers) < self.world - 1:
                conn, addr, msg, reason, of_this_job = next(heard, None) or self._timed_out(peers)
                if reason is None and msg.kind == FAIL:
                    conn.close()
                    self._abort(f"process {msg.rank} failed: {msg.reason}", msg.rank, peers, deadline,
                                f"process {msg.rank} failed before joining: {msg.reason}")
                if reason is None and peers[msg.rank] is not None:
                    reason = f"rank {msg.rank} has already joined"
                    of_this_job = False  # a stray second connection; the rank itself is here
                if reason is None and not hmac.compare_digest(msg.fingerprint, self.fingerprint):
                    reason = (f"rank {msg.rank} was started with a different configuration than rank 0 "
                              f"{CONFIGURATION_HINT}")
                if reason is None:
                    conn.setblocking(True)
                    conn.settimeout(HANDSHAKE_TIMEOUT_S)  # for the answer; no wait after that is bounded
                    peers[msg.rank], nonces[msg.rank] = conn, msg.nonce
                    continue
                who = f"{addr[0]}:{addr[1]}"
                self.refusals.refused(addr, reason)
                _refuse(conn, reason)
                if of_this_job:
                    # it holds the token, so it is a process of this job, and it can never join: the job
                    # cannot start, and every rank hears so now instead of at its timeout
                    self._abort(reason, msg.rank, peers, deadline,
                                f"rendezvous at {self.host}:{self.port}: refused {who}: {reason}")
            for rank in range(1, self.world):  # everyone is here: let them all go
                mac = _mac(self.token, b"accept", nonces[rank], payload)
                try:
                    peers[rank].sendall(_REPLY.pack(MAGIC, ACCEPT, mac, len(payload)) + payload)
                except OSError as e:
                    raise XtrainError(f"rendezvous at {self.host}:{self.port}: rank {rank} went away before "
                                      f"the start ({_describe(e)})") from None
                peers[rank].settimeout(None)
        except XtrainError:  # its own failures above, which the ranks waiting were told of
            close_all(peers)
            raise
        except Exception as err:
            # anything else that ends rank 0 here (a bug, a resource) would leave the joined ranks a closed
            # socket and the joining ones retrying until their timeout: they hear what ended rank 0 now
            self._abandon(f"process 0 failed: {_one_line(f'{type(err).__name__}: {err}')}", peers, deadline)
            raise
        except BaseException:  # Ctrl-C: leave at once; the joined ranks see the connections close
            close_all(peers)
            raise
        finally:
            self._close()
        return peers

    def _timed_out(self, peers: list):
        """The deadline passed before every rank joined: tell the joined ranks and raise."""
        missing = [str(r) for r in range(1, self.world) if peers[r] is None]
        why = (f"only {self.world - len(missing)} of {self.world} processes joined within "
               f"{self.timeout_s:g} s (missing rank {', '.join(missing)})")
        _refuse_joined(peers, why)  # the ranks waiting for the others hear it too
        refused = self.refusals.summary()
        raise XtrainError(f"rendezvous at {self.host}:{self.port}: {why}"
                          + (f"; refused: {refused}" if refused else ""))

    def _abandon(self, news: str, peers: list, deadline: float) -> None:
        """Rank 0 gives up serving: tell the joined ranks and then every joiner `news` (as _abort does), for
        at most LINGER_S. Best effort: it never raises, so the failure that ended the serving is the one seen."""
        try:
            told = {0, *_refuse_joined(peers, news)}
            self._tell_everyone(news, told, max(min(deadline - time.monotonic(), LINGER_S), 0))
        except (OSError, ValueError, OverflowError):
            close_all(peers)

    def _abort(self, news: str, lost: int, peers: list, deadline: float, error: str) -> None:
        """Rank `lost` will never join: tell the joined ranks `news`, then every joiner for a while (until
        all ranks know), so that they end now instead of at their timeout; then raise `error`."""
        # `lost` counts only if it is one of this job's ranks: a process started for a larger world may claim
        # a rank this job does not have, and counting it would stop the telling one real rank early
        told = {0, *_refuse_joined(peers, news), *([lost] if 0 < lost < self.world else [])}
        self._tell_everyone(news, told, min(deadline - time.monotonic(), LINGER_S))
        raise XtrainError(error)

    def refuse_all(self, reason: str, linger_s: float = 30.0) -> None:
        """Rank 0 failed before serving: answer every joiner with REFUSE "process 0 failed: reason"
        until all other ranks know or `linger_s` passed. Best effort: it never raises OSError."""
        try:
            self._tell_everyone(f"process 0 failed: {_one_line(reason)}", {0}, linger_s)
        except OSError:
            pass
        finally:
            self._close()

    def _tell_everyone(self, news: str, told: set[int], linger_s: float) -> None:
        """Answer every connection with REFUSE `news` (a stranger: with why it is refused) until every
        rank is in `told` or `linger_s` passed. A FAIL counts as told: that rank knows it failed."""
        if len(told) >= self.world:
            return
        for conn, addr, msg, reason, _ in self._hear_all(time.monotonic() + linger_s):
            if reason is None:
                told.add(msg.rank)
            else:
                self.refusals.refused(addr, reason)
            _refuse(conn, news if reason is None else reason)
            if len(told) >= self.world:
                return

    def _close(self) -> None:
        """Stop listening; drop the connections not yet heard (named in the log: no rank is among them)."""
        for greeted in self.pending.values():
            self.refusals.refused(greeted.addr, "no valid greeting (the rendezvous ended before it was heard)")
            greeted.conn.close()
        self.pending.clear()
        self.selector.close()
        self.sock.close()
        self.refusals.flush()

    def _hear_all(self, until: float):
        """Yield a _Heard for each connection as its message arrives whole, or as it fails to (it closed,
        sent what is not our message, or took longer than GREETING_TIMEOUT_S), until the monotonic time
        `until`. New connections are accepted and greeted meanwhile, every one at once."""
        while True:
            now = time.monotonic()
            for greeted in [g for g in self.pending.values() if g.deadline <= now]:
                yield self._drop(greeted, "no valid greeting (timed out)")
            if now >= until:
                return
            wake = min([until, *(g.deadline for g in self.pending.values())])
            for key, _ in self.selector.select(wake - now):
                if key.fileobj is self.sock:
                    yield from self._accept_all()
                elif key.fileobj in self.pending:  # still waited for (nothing above dropped it meanwhile)
                    heard = self._read(key.data)
                    if heard is not None:
                        yield heard

    def _accept_all(self):
        """Accept and greet the connections waiting in the kernel's queue (at most MAX_PENDING at a time,
        so that a flood cannot hold this loop); yield a _Heard for each one dropped to make room."""
        for _ in range(MAX_PENDING):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the connection was reset while it waited in the queue, or no descriptor is left
                return
            conn.setblocking(False)
            greeted = _Greeted(conn, addr, secrets.token_bytes(32), time.monotonic() + GREETING_TIMEOUT_S)
            try:
                if conn.send(_GREETING.pack(MAGIC, VERSION, greeted.nonce)) != _GREETING.size:
                    raise BlockingIOError("the greeting did not fit in the socket's buffer")
            except OSError as e:
                yield _Heard(conn, addr, None, f"no valid greeting ({_describe(e)})", False)
                continue
            self.pending[conn] = greeted
            self.selector.register(conn, selectors.EVENT_READ, greeted)
            if len(self.pending) > MAX_PENDING:
                yield self._drop(self._crowded(), "no valid greeting (too many connections waiting to be heard)")

    def _crowded(self) -> _Greeted:
        """The connection to drop when too many wait: the oldest of the host that holds most of them, so a
        host that floods the port drops its own connections rather than a rank's."""
        by_host: dict[str, list[_Greeted]] = {}
        for greeted in self.pending.values():  # oldest first: a dict keeps the order of insertion
            by_host.setdefault(greeted.addr[0], []).append(greeted)
        return max(by_host.values(), key=len)[0]

    def _drop(self, greeted: _Greeted, reason: str) -> _Heard:
        self._forget(greeted)
        return _Heard(greeted.conn, greeted.addr, None, reason, False)

    def _forget(self, greeted: _Greeted) -> None:
        self.selector.unregister(greeted.conn)
        del self.pending[greeted.conn]

    def _read(self, greeted: _Greeted) -> _Heard | None:
        """Read what has arrived of `greeted`'s message: a _Heard once it is whole or cannot be, else None."""
        try:
            chunk = greeted.conn.recv(greeted.size - len(greeted.data))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            return self._drop(greeted, f"no valid greeting ({_describe(e)})")
        if not chunk:
            return self._drop(greeted, "no valid greeting (connection closed by the other side)")
        greeted.data += chunk
        if len(greeted.data) == _JOIN.size:  # the fixed part: is it ours, and how long is the rest?
            magic, version, kind, _, _, _, _, _, length = _JOIN.unpack(greeted.data)
            if magic != MAGIC:
                return self._drop(greeted, "not an xtrain-dist process")
            if version != VERSION:
                return self._drop(greeted, f"protocol version {version}, rank 0 speaks {VERSION}")
            if kind not in (JOIN, FAIL) or length > (MAX_REASON if kind == FAIL else 0):
                return self._drop(greeted, "a malformed message")
            greeted.size += length
        if len(greeted.data) < greeted.size:
            return None
        self._forget(greeted)
        return _Heard(greeted.conn, greeted.addr, *self._judge(greeted.nonce, bytes(greeted.data)))

    def _judge(self, server_nonce: bytes, data: bytes) -> tuple[_Message, str | None, bool]:
        """A whole message, checked: (message, None, True) when it holds the token and fits this job, else
        (message, why it is refused, whether it holds the token: a process of this job that does not fit
        it, rather than a stranger)."""
        _, _, kind, rank, world, fingerprint, peer_nonce, mac, _ = _JOIN.unpack(data[:_JOIN.size])
        text = data[_JOIN.size:]
        ranks = struct.pack("!II", rank, world)
        if kind == JOIN:
            expected = _mac(self.token, b"join", server_nonce, ranks, fingerprint, peer_nonce)
        else:
            expected = _mac(self.token, b"fail", server_nonce, ranks, text)
        msg = _Message(kind, rank, fingerprint, peer_nonce, _one_line(text.decode(errors="replace")))
        if not hmac.compare_digest(mac, expected):
            return msg, f"wrong token (set the same {TOKEN_ENV} for every process)", False
        if world != self.world:
            return msg, f"rank {rank} expects a world of {world} processes, rank 0 has {self.world}", True
        if not 0 < rank < self.world:
            return msg, f"rank {rank} is outside 1..{self.world - 1}", True
        return msg, None, True


def join(advertise: tuple[str, int], rank: int, world: int, token: bytes, fingerprint: bytes = b"",
         timeout_s: float = 300.0) -> tuple[bytes, socket.socket]:
    """A peer's side: connect to rank 0 (retrying until it listens), prove the token, wait until every
    process has joined; return the payload and the open connection."""
    host, port = advertise
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise XtrainError(f"rendezvous: no answer from rank 0 at {where} within {timeout_s:g} s ({last}); "
                              "is rank 0 running, and is this the address the other processes reach "
                              "(MASTER_ADDR/MASTER_PORT or --rdzv-advertise)?")
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, HANDSHAKE_TIMEOUT_S))
        except socket.gaierror as e:
            raise XtrainError(f"rendezvous: cannot resolve rank 0's address {where} ({e.strerror})") from None
        except OSError as e:
            last = _describe(e)
            time.sleep(min(0.2, max(remaining, 0)))
            continue
        try:
            sock.settimeout(min(max(deadline - time.monotonic(), 0.1), HANDSHAKE_TIMEOUT_S))
            return _join_over(sock, where, rank, world, token, fingerprint, deadline, timeout_s), sock
        except OSError as e:  # rank 0 went away mid-handshake (a restart?): try again until the deadline
            sock.close()
            last = f"handshake: {_describe(e)}"
        except BaseException:
            sock.close()
            raise


def _join_over(sock, where, rank, world, token, fingerprint, deadline, timeout_s) -> bytes:
    magic, version, server_nonce = _GREETING.unpack(_recv_exact(sock, _GREETING.size))
    if magic != MAGIC:
        raise XtrainError(f"rendezvous: {where} is not an xtrain-dist rendezvous (it sent {magic!r}); under torchrun "
                          "MASTER_PORT belongs to torchrun itself, so the rendezvous uses MASTER_PORT+1")
    if version != VERSION:
        raise XtrainError(f"rendezvous: rank 0 at {where} speaks protocol version {version}, this process {VERSION}")
    peer_nonce = secrets.token_bytes(32)
    fingerprint = hashlib.sha256(fingerprint).digest()
    sock.sendall(_JOIN.pack(MAGIC, VERSION, JOIN, rank, world, fingerprint, peer_nonce,
                            _mac(token, b"join", server_nonce, struct.pack("!II", rank, world), fingerprint,
                                 peer_nonce), 0))
    sock.settimeout(max(deadline - time.monotonic(), 0.1))  # rank 0 answers once every rank has joined
    try:
        magic, status, mac, length = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
        if magic != MAGIC or length > MAX_BODY:
            raise XtrainError(f"rendezvous: {where} answered with malformed bytes")
        body = _recv_exact(sock, length)
    except TimeoutError:
        raise XtrainError(f"rendezvous: rank {rank} reached rank 0 at {where}, but not every process joined within "
                          f"{timeout_s:g} s (rank 0 names the missing ranks)") from None
    except OSError as e:
        raise XtrainError(f"rendezvous: rank 0 at {where} went away while rank {rank} waited for the other "
                          f"processes ({_describe(e)}): see rank 0's error") from None
    if status == REFUSE:
        raise XtrainError(f"rendezvous: rank 0 at {where} refused rank {rank}: {body.decode(errors='replace')}")
    if status != ACCEPT or not hmac.compare_digest(mac, _mac(token, b"accept", peer_nonce, body)):
        raise XtrainError(f"rendezvous: {where} answered without proof of the token: "
                          f"not our rank 0, or a different {TOKEN_ENV}")
    sock.settimeout(None)
    return body


def report_failure(advertise: tuple[str, int], rank: int, world: int, token: bytes, reason: str,
                   timeout_s: float = 30.0) -> None:
    """A peer that fails before it joins tells rank 0 why (retrying until rank 0 listens), so rank 0 and
    the others stop waiting for it. Best effort within `timeout_s`: it never raises, never waits longer."""
    text = _one_line(reason).encode()
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return min(deadline - time.monotonic(), HANDSHAKE_TIMEOUT_S)

    # ValueError: a negative socket timeout, when the deadline passed meanwhile
    while left() > 0:
        try:
            sock = socket.create_connection(advertise, timeout=left())
        except socket.gaierror:
            return
        except (OSError, ValueError):  # rank 0 does not listen yet: try again until the deadline
            time.sleep(max(min(0.2, left()), 0))
            continue
        with sock:
            try:
                sock.settimeout(left())
                magic, version, server_nonce = _GREETING.unpack(_recv_exact(sock, _GREETING.size))
                if magic != MAGIC or version != VERSION:
                    return
                mac = _mac(token, b"fail", server_nonce, struct.pack("!II", rank, world), text)
                sock.sendall(_JOIN.pack(MAGIC, VERSION, FAIL, rank, world, bytes(32), bytes(32), mac, len(text))
                             + text)
            except (OSError, ValueError):  # rank 0 went away mid-handshake: try again until the deadline
                time.sleep(max(min(0.2, left()), 0))
                continue
            with contextlib.suppress(OSError, ValueError):  # wait (bounded) until rank 0 has read it and closes
                sock.settimeout(left())
                while sock.recv(4096):
                    pass
            return


def close_all(socks) -> None:
    for s in socks:
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def rdzv_addresses(launch: Launch, bind: str | None, advertise: str | None) -> tuple[tuple, tuple]:
    """(bind, advertise) as (host, port): the others connect to `advertise` (default MASTER_ADDR and
    MASTER_PORT, or MASTER_PORT+1 under torchrun, whose agent holds MASTER_PORT); rank 0 listens on
    `bind` (default: the advertised address; a bind without a port takes the advertised port)."""
    adv = parse_hostport(advertise, None, "--rdzv-advertise") if advertise else (launch.master_addr, launch.rdzv_port)
    return (parse_hostport(bind, adv[1], "--rdzv-bind") if bind else adv), adv


def spans_hosts(launch: Launch, advertised_host: str) -> bool:
    """Whether the job runs processes on other hosts than rank 0's: its launcher counts fewer processes on
    this host than in the job, and the others reach rank 0 at an address that is not this host's loopback
    (a launch by hand may not say how many processes share a host; one on 127.0.0.1 spans one host)."""
    if launch.local_processes >= launch.num_processes:
        return False
    try:
        return not ipaddress.ip_address(advertised_host).is_loopback
    except ValueError:  # a name
        return advertised_host != "localhost"


def rendezvous(launch: Launch, payload: bytes = b"", *, bind=None, advertise=None, timeout_s=300.0,
               fingerprint: bytes = b"", log=print):
    """Rank 0 hands `payload` to every process over TCP; returns (payload, open connections as the TCP
    communicator wants them)."""
    bind_at, adv = rdzv_addresses(launch, bind, advertise)
    token = token_from_env(derived_token(launch.job_id, *adv))
    if launch.process_rank == 0:
        server = RendezvousServer(bind_at, launch.num_processes, token, fingerprint, timeout_s, log=log)
        if not os.environ.get(TOKEN_ENV) and spans_hosts(launch, adv[0]):
            # rank 0 only: one line for the job, in the log of the process whose port is open to others
            log(f"rendezvous: {TOKEN_ENV} is not set, and the launcher puts {launch.local_processes} of this job's "
                f"{launch.num_processes} processes on this host: the token is derived from the job id and rank "
                f"0's address, which anyone who can reach {adv[0]}:{adv[1]} can work out; set the same secret "
                f"{TOKEN_ENV} for every process")
        return payload, server.serve(payload)
    body, conn = join(adv, launch.process_rank, launch.num_processes, token, fingerprint, timeout_s)
    return body, [conn]


def report_failure_before_world(launch: Launch, reason: str, *, bind=None, advertise=None,
                                timeout_s: float = 30.0, wait: bool = True) -> None:
    """A process that fails before it reaches the rendezvous (a missing file on its node) tells the
    others why, so they end at once instead of at --rdzv-timeout: rank 0 answers every joiner with the
    reason, another rank tells rank 0 (who then tells the rest). Best effort, at most about `timeout_s`;
    it never raises. Nothing to do for one process or under mpirun (MPI_Abort ends the job). Only for
    failures before this process calls rendezvous(): its failures there already reach the others, and
    reporting again would wait for nobody. `bind` and `advertise` as for rendezvous().

    wait=False reports from a thread that is not a daemon and returns at once: the process says what went
    wrong now, and Python waits for the thread before the process exits. The others may not listen yet
    (rank 0 still reading its corpus or compiling its kernels, a node started later), and the line of the
    process that failed waited with them, up to 30 s: under torchrun nothing was reported until then."""
    if not launch.multi_process or launch.kind == "mpirun":
        return
    if not wait:
        threading.Thread(target=report_failure_before_world, args=(launch, reason), name="report-failure",
                         kwargs={"bind": bind, "advertise": advertise, "timeout_s": timeout_s}).start()
        return
    try:
        bind_at, adv = rdzv_addresses(launch, bind, advertise)
        token = token_from_env(derived_token(launch.job_id, *adv))
        if launch.process_rank == 0:
            server = RendezvousServer(bind_at, launch.num_processes, token, log=lambda line: None)
            server.refuse_all(reason, timeout_s)
        else:
            report_failure(adv, launch.process_rank, launch.num_processes, token, reason, timeout_s)
    except (XtrainError, OSError):  # a bad address or a port in use: the others learn at their timeout
        pass
