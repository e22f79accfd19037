"""A stand-in for nccl4py (`nccl.core`, `nccl.bindings.nccl`) for rank threads of one process on the
simulator's devices, so xtrain_dist/comm/nccl.py moves real data on the CPU.

`install()` puts it in sys.modules beside fake_cupy (tests/conftest.py, when XTRAIN_CUDASIM=1). The
surface is the one nccl.py uses, each name with nccl4py's parameters (tests/test_cudasim.py holds it to
the real nccl4py): the unique id, Communicator.init / abort / finalize / destroy, group_start /
group_end, the error strings and NCCLError, and the five collectives on raw pointers, counts, NCCL data
types and streams.

Semantics. The communicators made from one unique id form a clique. A collective blocks its caller
until every rank of the clique has called the same collective (name, count, type, root), copies every
rank's send buffer, meets again, and then each rank writes its own result, summing in rank order (the
real NCCL's order is its ring's; only the in-rank-order part is promised here: every rank gets the same
bits). Inits do not block, as inside the group nccl.py makes them in. Two ranks calling different
collectives, or one never coming, fail in the clique's words instead of hanging.
What it cannot see: several processes, NCCL's transports, its real summation order, its speed.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
import threading
import types

import fake_cupy
import numpy as np

from xtrain_dist.comm.local import _Barrier

FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = 6, 7, 8, 9  # ncclDataType_t
INT32, INT64, UINT8 = 2, 4, 1
SUM = 0
_ITEM = {FLOAT16: 2, FLOAT32: 4, FLOAT64: 8, BFLOAT16: 2, INT32: 4, INT64: 8, UINT8: 1}
_NUMPY = {FLOAT32: np.float32, FLOAT64: np.float64, INT32: np.int32, INT64: np.int64, UINT8: np.uint8,
          FLOAT16: np.float16}
TIMEOUT_S = float(os.environ.get("XTRAIN_CUDASIM_NCCL_TIMEOUT", "60"))


_RESULT_NAMES = {0: "Success", 4: "InvalidArgument", 5: "InvalidUsage", 6: "RemoteError", 7: "InProgress"}


class NCCLError(Exception):
    """nccl.bindings.nccl.NCCLError: a status and NCCL's words for it ('RemoteError (6): remote process ...')."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"{_RESULT_NAMES.get(status, 'Result')} ({status}): {get_error_string(status)}")


def _error(status: int, detail: str) -> NCCLError:
    """NCCLError(status), its words followed by what the stand-in saw."""
    error = NCCLError(status)
    error.args = (f"{error.args[0]} ({detail})",)
    return error


class _Clique:
    def __init__(self, nranks: int):
        self.nranks = nranks
        # an abort breaks only the waits it interrupts, as on a GPU, where a peer's ncclCommAbort does not
        # undo a collective that has completed (threading.Barrier's abort would fail it on late wakers)
        self.barrier = _Barrier(nranks)
        self.calls: list = [None] * nranks
        self.data: list = [None] * nranks


_cliques: dict[bytes, _Clique] = {}
_comms: dict[int, Communicator] = {}
_lock = threading.Lock()
_ptrs = itertools.count(0x10000)


class UniqueId:
    def __init__(self, raw: bytes):
        self.raw = raw

    @staticmethod
    def from_bytes(b: bytes) -> UniqueId:
        if len(b) != 128:
            raise ValueError(f"a unique id has 128 bytes, got {len(b)}")
        return UniqueId(bytes(b))

    @property
    def as_bytes(self) -> bytes:  # a property in nccl4py too: nccl.py reads get_unique_id().as_bytes
        return self.raw


def get_unique_id() -> UniqueId:
    return UniqueId(os.urandom(128))


class Communicator:
    def __init__(self, clique: _Clique, rank: int):
        self.clique, self.rank, self.nranks = clique, rank, clique.nranks
        self.ptr = next(_ptrs)
        self.aborted = False

    @staticmethod
    def init(nranks: int, rank: int, unique_id: UniqueId) -> Communicator:
        if not 0 <= rank < nranks:
            raise _error(4, f"rank {rank} of {nranks}")
        with _lock:
            clique = _cliques.setdefault(unique_id.raw, _Clique(nranks))
            if clique.nranks != nranks:
                raise _error(5, f"{nranks} ranks for a unique id first used with {clique.nranks}")
            comm = Communicator(clique, rank)
            _comms[comm.ptr] = comm
        return comm

    def get_async_error(self) -> int:
        return 0

    def get_last_error(self) -> str:
        return ""

    def abort(self) -> None:
        self.aborted = True
        self.clique.barrier.abort()  # releases peers waiting in a collective, as ncclCommAbort does

    def finalize(self) -> None:
        pass

    def destroy(self) -> None:
        with _lock:
            _comms.pop(self.ptr, None)


def group_start() -> None:
    pass


def group_end() -> None:
    pass


def get_error_string(nccl_result: int) -> str:
    return {0: "no error", 4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
            5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
            6: "remote process exited or there was a network error"}.get(int(nccl_result), f"NCCL status {nccl_result}")


# ---------------------------------------------------------------------------- the collectives

def _memory(ptr: int, data_type: int, count: int) -> np.ndarray:
    nbytes = count * _ITEM[data_type]
    raw = np.ctypeslib.as_array((ctypes.c_char * max(nbytes, 1)).from_address(ptr))[:nbytes]
    return raw.view(np.uint16 if data_type == BFLOAT16 else _NUMPY[data_type])


def _sum(parts: list[np.ndarray], data_type: int) -> np.ndarray:
    if data_type == BFLOAT16:  # add in float32, rounding to bf16 after each addition, as a bf16 ring does
        total = (parts[0].astype(np.uint32) << 16).view(np.float32)
        for part in parts[1:]:
            total = total + (part.astype(np.uint32) << 16).view(np.float32)
            total = _bf16(total)
        return (total.view(np.uint32) >> 16).astype(np.uint16)
    total = parts[0].copy()
    for part in parts[1:]:
        total = total + part
    return total


def _bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _meet(comm: Communicator, what: str) -> None:
    try:
        comm.clique.barrier.wait(TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise _error(6, f"rank {comm.rank}'s {what}: a peer aborted or never came (fake NCCL, "
                           f"{TIMEOUT_S:g} s)") from None


def _collective(handle, call: tuple, send: np.ndarray | None, finish) -> None:
    comm = _comms.get(int(handle))
    if comm is None or comm.aborted:
        raise _error(4, "a destroyed or aborted communicator")
    clique = comm.clique
    clique.calls[comm.rank] = call
    clique.data[comm.rank] = None if send is None else send.copy()
    _meet(comm, call[0])
    if any(c != clique.calls[0] for c in clique.calls):
        error = _error(5, f"ranks called different collectives: {clique.calls}")
        _meet(comm, call[0])
        raise error
    finish(clique.data)
    _meet(comm, call[0])  # every rank has read the others' copies before the next collective replaces them


def _queued(stream, what: str, send: int, send_count: int, recv: int, recv_count: int, data_type: int) -> None:
    """Tell the stream checker (tests/cudasim/streams.py) what this rank's collective reads and writes on
    its stream: its own send and receive buffers; the exchange with the peers is NCCL's own business."""
    item = _ITEM[data_type]
    fake_cupy.raw_operation(stream, f"nccl {what}", [(send, send + send_count * item, False),
                                                     (recv, recv + recv_count * item, True)])


def _bindings() -> types.ModuleType:
    raw = types.ModuleType("nccl.bindings.nccl")
    raw.Result = types.SimpleNamespace(Success=0, InProgress=7)
    raw.NCCLError = NCCLError

    def Comm(handle=0):  # nccl4py's non-owning wrapper of a raw ncclComm_t; here the pointer is the handle
        return int(handle)

    raw.Comm = Comm

    def all_reduce(sendbuff, recvbuff, count, datatype, op, comm, stream):
        _queued(stream, "all_reduce", sendbuff, count, recvbuff, count, datatype)
        out = _memory(recvbuff, datatype, count)
        _collective(comm, ("all_reduce", count, datatype, op), _memory(sendbuff, datatype, count),
                    lambda parts: out.__setitem__(slice(None), _sum(parts, datatype)))

    def reduce_scatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream):
        rank = _comms[int(comm)].rank
        n = _comms[int(comm)].nranks
        _queued(stream, "reduce_scatter", sendbuff, recvcount * n, recvbuff, recvcount, datatype)
        out = _memory(recvbuff, datatype, recvcount)
        _collective(comm, ("reduce_scatter", recvcount, datatype, op), _memory(sendbuff, datatype, recvcount * n),
                    lambda parts: out.__setitem__(slice(None), _sum(
                        [p[rank * recvcount:(rank + 1) * recvcount] for p in parts], datatype)))

    def all_gather(sendbuff, recvbuff, sendcount, datatype, comm, stream):
        n = _comms[int(comm)].nranks
        _queued(stream, "all_gather", sendbuff, sendcount, recvbuff, sendcount * n, datatype)
        out = _memory(recvbuff, datatype, sendcount * n)
        _collective(comm, ("all_gather", sendcount, datatype), _memory(sendbuff, datatype, sendcount),
                    lambda parts: out.__setitem__(slice(None), np.concatenate(parts)))

    def broadcast(sendbuff, recvbuff, count, datatype, root, comm, stream):
        rank = _comms[int(comm)].rank
        _queued(stream, "broadcast", sendbuff, count if rank == root else 0, recvbuff, count, datatype)
        out = _memory(recvbuff, datatype, count)
        _collective(comm, ("broadcast", count, datatype, root),
                    _memory(sendbuff, datatype, count) if rank == root else None,
                    lambda parts: out.__setitem__(slice(None), parts[root]))

    def reduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream):
        rank = _comms[int(comm)].rank
        _queued(stream, "reduce", sendbuff, count, recvbuff, count if rank == root else 0, datatype)

        def finish(parts):
            if rank == root:
                _memory(recvbuff, datatype, count)[:] = _sum(parts, datatype)

        _collective(comm, ("reduce", count, datatype, op, root), _memory(sendbuff, datatype, count), finish)

    def queued(collective):
        """The collective queued on its stream (the last argument): run now, or recorded into the graph that
        stream captures and run at each launch (NCCL calls are capturable)."""
        @functools.wraps(collective)  # keeps nccl4py's parameter names, which tests/test_nccl_logic.py checks
        def run(*args):
            fake_cupy._queue(args[-1], lambda: collective(*args))

        return run

    raw.all_reduce, raw.reduce_scatter, raw.all_gather = queued(all_reduce), queued(reduce_scatter), queued(all_gather)
    raw.broadcast, raw.reduce = queued(broadcast), queued(reduce)
    raw.send, raw.recv = queued(_send), queued(_recv)
    return raw


# ---------------------------------------------------------------------------- groups and point-to-point
# A split is a collective of the parent clique that makes one new clique per color; a send posts a copy
# into the (sender, receiver) mailbox of its clique and returns, a recv waits for the oldest message
# there, so a send and a recv in one group (or in either order on two threads) meet as NCCL's do.

_split_cliques: dict[tuple, _Clique] = {}
_mail: dict[tuple, list] = {}
_mail_ready = threading.Condition()


def _split(self: Communicator, color: int | None = None, key: int = 0, config=None) -> Communicator | None:
    """nccl4py's Communicator.split; color None joins no group (nccl4py gives a null communicator: None here)."""
    found = {"comm": None}

    def finish(parts):
        self.splits = getattr(self, "splits", 0) + 1  # every rank splits in the same order: a common name
        if color is None:
            return
        members = sorted((int(k), r) for r, (c, k) in enumerate(parts) if c == color)
        with _lock:
            clique = _split_cliques.setdefault((id(self.clique), self.splits, color), _Clique(len(members)))
            comm = Communicator(clique, [r for _, r in members].index(self.rank))
            _comms[comm.ptr] = comm
        found["comm"] = comm

    _collective(self.ptr, ("split",), np.array([-1 if color is None else color, key], np.int64), finish)
    return found["comm"]


def _send(sendbuff, count, datatype, peer, comm, stream):
    _queued(stream, "send", sendbuff, count, sendbuff, 0, datatype)
    sender = _comms.get(int(comm))
    if sender is None or sender.aborted:
        raise _error(4, "a destroyed or aborted communicator")
    with _mail_ready:
        _mail.setdefault((id(sender.clique), sender.rank, peer), []).append(
            (datatype, _memory(sendbuff, datatype, count).copy()))
        _mail_ready.notify_all()


def _recv(recvbuff, count, datatype, peer, comm, stream):
    _queued(stream, "recv", recvbuff, 0, recvbuff, count, datatype)
    receiver = _comms.get(int(comm))
    if receiver is None or receiver.aborted:
        raise _error(4, "a destroyed or aborted communicator")
    with _mail_ready:
        box = _mail.setdefault((id(receiver.clique), peer, receiver.rank), [])
        if not _mail_ready.wait_for(lambda: box or receiver.aborted, TIMEOUT_S) or receiver.aborted:
            raise _error(6, f"rank {receiver.rank}'s recv: rank {peer} never sent (fake NCCL, {TIMEOUT_S:g} s)")
        sent_type, data = box.pop(0)
    if (sent_type, data.size) != (datatype, count):
        raise _error(5, f"rank {peer} sent {data.size} elements of type {sent_type}, rank {receiver.rank} "
                        f"receives {count} of type {datatype}")
    _memory(recvbuff, datatype, count)[:] = data


_abort_alone = Communicator.abort


def _abort_and_wake_receivers(self: Communicator) -> None:
    _abort_alone(self)
    with _mail_ready:  # a recv waiting on a peer that aborted returns now, as ncclCommAbort releases it
        _mail_ready.notify_all()


Communicator.split = _split
Communicator.abort = _abort_and_wake_receivers


CORE_NAMES = ("UniqueId", "Communicator", "get_unique_id", "group_start", "group_end", "get_error_string",
              "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "INT32", "INT64", "UINT8", "SUM")


def core_module() -> types.ModuleType:
    """The stand-in's nccl.core: the names nccl.py uses, each one nccl4py's."""
    core = types.ModuleType("nccl.core")
    for name in CORE_NAMES:
        setattr(core, name, getattr(sys.modules[__name__], name))
    return core


def install() -> None:
    if getattr(sys.modules.get("nccl.bindings.nccl"), "NCCLError", None) is NCCLError:
        return  # installed already (site/sitecustomize.py, then conftest)
    core = core_module()
    package, bindings = types.ModuleType("nccl"), types.ModuleType("nccl.bindings")
    bindings.nccl = _bindings()
    package.core, package.bindings = core, bindings
    package.__path__ = []  # a package, so `import nccl.core` looks in sys.modules
    bindings.__path__ = []
    sys.modules.update({"nccl": package, "nccl.core": core, "nccl.bindings": bindings,
                        "nccl.bindings.nccl": bindings.nccl})
