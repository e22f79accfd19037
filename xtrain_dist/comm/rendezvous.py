"""Rendezvous: every process of a job finds rank 0 over TCP and receives the same few bytes (NCCL's
unique id) from it; the connections it leaves open carry the TCP communicator's traffic.

Nothing unsafe crosses the socket: fixed-format messages (a magic, a version, fixed-size fields and one
length-prefixed body of at most 64 KiB; no pickle), and a shared token that never travels itself:

    rank 0 -> peer   MAGIC version server_nonce
    peer -> rank 0   MAGIC version rank world fingerprint peer_nonce HMAC(token, "join" server_nonce rank world
                                                                              fingerprint peer_nonce)
    rank 0 -> peer   MAGIC status=ACCEPT HMAC(token, "accept" peer_nonce body) len body    (body: the payload)
                  or MAGIC status=REFUSE 0*32 len reason

Rank 0 checks the peer's HMAC with hmac.compare_digest, the peer checks rank 0's, so neither side accepts
bytes from a process that does not hold the token. `fingerprint` is a digest of the run's configuration:
a process started with a different command line is refused with a line that says so.

Rank 0 binds only the address it is told (`bind`); the others connect to the address they are told
(`advertise`). The two differ behind docker or NAT: inside a container rank 0 binds the container's
address (or 0.0.0.0) while the others connect to the host's address and a published port.
"""

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import struct
import time

from ..errors import XtrainError

MAGIC = b"XTRZ"
VERSION = 1
MAX_BODY = 64 * 1024
ACCEPT, REFUSE = 0, 1
TOKEN_ENV = "XTRAIN_RDZV_TOKEN"

_GREETING = struct.Struct("!4sH32s")              # magic, version, server nonce
_JOIN = struct.Struct("!4sHII32s32s32s")          # magic, version, rank, world, fingerprint, peer nonce, mac
_REPLY = struct.Struct("!4sB32sI")                # magic, status, mac, body length
HANDSHAKE_TIMEOUT_S = 10.0                        # one peer's handshake, once connected


def parse_hostport(text: str, default_port: int | None, what: str) -> tuple[str, int]:
    """'host', 'host:port', '[v6addr]:port' -> (host, port)."""
    host, port = text, None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
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


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return str(err) or type(err).__name__


class RendezvousServer:
    """Rank 0's side. Listens as soon as it is made, so a port in use is an error at once."""

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
            self.sock.listen(max(16, world))
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

    def serve(self, payload: bytes = b"") -> list[socket.socket | None]:
        """Hand `payload` to ranks 1..world-1; return their connections by rank (index 0 is None)."""
        if len(payload) > MAX_BODY:
            raise ValueError("rendezvous payload too large")
        peers: list[socket.socket | None] = [None] * self.world
        refused: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        try:
            while sum(p is not None for p in peers) < self.world - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [str(r) for r in range(1, self.world) if peers[r] is None]
                    raise XtrainError(
                        f"rendezvous at {self.host}:{self.port}: only {self.world - len(missing)} of {self.world} "
                        f"processes joined within {self.timeout_s:g} s (missing rank {', '.join(missing)})"
                        + (f"; refused: {'; '.join(refused)}" if refused else ""))
                self.sock.settimeout(remaining)
                try:
                    conn, addr = self.sock.accept()
                except TimeoutError:
                    continue
                rank, reason = self._handshake(conn, peers, payload, min(HANDSHAKE_TIMEOUT_S, remaining))
                if reason is None:
                    peers[rank] = conn
                else:
                    who = f"{addr[0]}:{addr[1]}"
                    refused.append(f"{who} ({reason})")
                    self.log(f"rendezvous: refused a connection from {who}: {reason}")
                    conn.close()
        except BaseException:
            for p in peers:
                if p is not None:
                    p.close()
            raise
        finally:
            self.sock.close()
        return peers

    def _handshake(self, conn, peers, payload, timeout_s) -> tuple[int, str | None]:
        conn.settimeout(timeout_s)
        server_nonce = secrets.token_bytes(32)
        try:
            conn.sendall(_GREETING.pack(MAGIC, VERSION, server_nonce))
            magic, version, rank, world, fingerprint, peer_nonce, mac = _JOIN.unpack(_recv_exact(conn, _JOIN.size))
        except (OSError, ConnectionError, struct.error) as e:
            return -1, f"no valid greeting ({_describe(e)})"
        if magic != MAGIC:
            return -1, "not an xtrain-dist process"
        reason = None
        if version != VERSION:
            reason = f"protocol version {version}, rank 0 speaks {VERSION}"
        elif not hmac.compare_digest(mac, _mac(self.token, b"join", server_nonce, struct.pack("!II", rank, world),
                                                fingerprint, peer_nonce)):
            reason = f"wrong token (set the same {TOKEN_ENV} for every process)"
        elif world != self.world:
            reason = f"it expects a world of {world} processes, rank 0 has {self.world}"
        elif not 0 < rank < self.world:
            reason = f"rank {rank} is outside 1..{self.world - 1}"
        elif peers[rank] is not None:
            reason = f"rank {rank} has already joined"
        elif not hmac.compare_digest(fingerprint, self.fingerprint):
            reason = f"rank {rank} was started with a different configuration than rank 0 (another command line?)"
        try:
            if reason is None:
                body, mac = payload, _mac(self.token, b"accept", peer_nonce, payload)
                conn.sendall(_REPLY.pack(MAGIC, ACCEPT, mac, len(body)) + body)
            else:
                body = reason.encode()
                conn.sendall(_REPLY.pack(MAGIC, REFUSE, bytes(32), len(body)) + body)
        except OSError as e:
            return -1, f"lost during the handshake ({_describe(e)})"
        conn.settimeout(None)
        return rank, reason


def join(advertise: tuple[str, int], rank: int, world: int, token: bytes, fingerprint: bytes = b"",
         timeout_s: float = 300.0) -> tuple[bytes, socket.socket]:
    """A peer's side: connect to rank 0 (retrying until it listens), prove the token, return the payload
    and the open connection."""
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
            return _join_over(sock, where, rank, world, token, fingerprint), sock
        except OSError as e:  # rank 0 went away mid-handshake (a restart?): try again until the deadline
            sock.close()
            last = f"handshake: {_describe(e)}"
        except BaseException:
            sock.close()
            raise


def _join_over(sock, where, rank, world, token, fingerprint) -> bytes:
    magic, version, server_nonce = _GREETING.unpack(_recv_exact(sock, _GREETING.size))
    if magic != MAGIC:
        raise XtrainError(f"rendezvous: {where} is not an xtrain-dist rendezvous (it sent {magic!r}); under torchrun "
                          "MASTER_PORT belongs to torchrun itself, so the rendezvous uses MASTER_PORT+1")
    if version != VERSION:
        raise XtrainError(f"rendezvous: rank 0 at {where} speaks protocol version {version}, this process {VERSION}")
    peer_nonce = secrets.token_bytes(32)
    fingerprint = hashlib.sha256(fingerprint).digest()
    sock.sendall(_JOIN.pack(MAGIC, VERSION, rank, world, fingerprint, peer_nonce,
                            _mac(token, b"join", server_nonce, struct.pack("!II", rank, world), fingerprint,
                                 peer_nonce)))
    magic, status, mac, length = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
    if magic != MAGIC or length > MAX_BODY:
        raise XtrainError(f"rendezvous: {where} answered with malformed bytes")
    body = _recv_exact(sock, length)
    if status == REFUSE:
        raise XtrainError(f"rendezvous: rank 0 at {where} refused rank {rank}: {body.decode(errors='replace')}")
    if status != ACCEPT or not hmac.compare_digest(mac, _mac(token, b"accept", peer_nonce, body)):
        raise XtrainError(f"rendezvous: {where} answered without proof of the token: "
                          f"not our rank 0, or a different {TOKEN_ENV}")
    sock.settimeout(None)
    return body


def close_all(socks) -> None:
    for s in socks:
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
