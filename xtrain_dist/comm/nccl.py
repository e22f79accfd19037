"""The NCCL communicator: GPU rank threads, in one process or many, through nccl4py.

nccl4py (PyPI `nccl4py`, module `nccl`) is NVIDIA's Python binding of NCCL. We use its Pythonic layer
`nccl.core` to make and end communicators (get_unique_id, Communicator.init / abort / finalize /
destroy, group_start / group_end, get_async_error, get_error_string) and its thin layer `nccl.bindings`
for the collectives themselves, which take raw device pointers, an element count, an NCCL data type and
a raw stream handle: exactly what a CuPy array (`a.data.ptr`, `a.size`) and a CuPy stream (`s.ptr`)
give, with no wrapping per call, and bf16 carried in uint16 arrays works as well as float32.

How a world comes up (open_nccl_world):
  1. global rank 0 (process 0, thread 0) calls ncclGetUniqueId: 128 opaque bytes;
  2. the bytes reach every process: through MPI_Bcast under mpirun, else through the TCP rendezvous
     (rendezvous.py), and within a process every thread shares them;
  3. the process's main thread sets each thread's device and calls ncclCommInitRank for all its ranks
     inside one ncclGroupStart/End: a single thread cannot block in one rank's init while its other ranks
     have not started theirs, which is how a sequence of inits without the group would deadlock.

Collectives are enqueued on the rank's stream. By default that is the calling
thread's current CuPy stream, which is the null stream unless someone set one: the CUDA backend gives
each rank its own non-blocking stream and makes it current, and a non-blocking stream does not wait for
the null stream, so NCCL must run on the very stream the gradients were computed on. A communicator
(`world.communicator(local, stream)`) or a call (`stream=`) can name another, e.g. a communication
stream for overlap. They return at once: stream order, not the host, makes the result visible to the
next kernel. Failure is collective and never a hang: a watchdog thread polls every communicator's async
error and the age of the oldest unfinished collective; on an NCCL error or a timeout it aborts every
communicator of the process (ncclCommAbort releases kernels waiting on dead peers), the rank threads'
next collective raises CommAborted with NCCL's error string, and the launcher ends the run.
"""

import collections
import contextlib
import threading
import time

from ..errors import XtrainError, install_hint
from . import CommAborted, check_peer, check_split, rank_share_offsets

WATCHDOG_PERIOD_S = 0.2


def nccl_modules():
    """(nccl.core, nccl.bindings.nccl, cupy), or one clear line saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise XtrainError(f"--comm nccl needs CuPy: {e} ({install_hint('cuda')})") from None
    try:
        import nccl.core as nccl
        from nccl.bindings import nccl as raw
    except ImportError as e:
        raise XtrainError(f"--comm nccl needs nccl4py: {e} ({install_hint('cuda')})") from None
    return nccl, raw, cupy


def visible_gpus(cupy) -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device: CUDA says so in its own words
        return 0


def _data_types(nccl) -> dict:
    return {"float32": nccl.FLOAT32, "bfloat16": nccl.BFLOAT16, "bf16": nccl.BFLOAT16, "float16": nccl.FLOAT16,
            "float64": nccl.FLOAT64, "int32": nccl.INT32, "int64": nccl.INT64, "uint8": nccl.UINT8}


class NcclWorld:
    """The NCCL communicators of this process's rank threads, their watchdog, and collective abort."""

    def __init__(self, launch, local_world: int, devices: list[int], unique_id: bytes, timeout_s: float = 300.0):
        self.nccl, self.raw, self.cupy = nccl_modules()
        self.engine, self.launch, self.local_world = "nccl", launch, local_world
        self.world_size = launch.num_processes * local_world
        self.devices, self.timeout_s = devices, timeout_s
        self.abort_reason: str | None = None
        self._lock = threading.Lock()
        self.dtypes = _data_types(self.nccl)
        uid = self.nccl.UniqueId.from_bytes(unique_id)
        self.comms = []
        self.groups = []  # (local, communicator) of every group split off (ncclCommSplit): aborted with the world
        try:
            self.nccl.group_start()
            try:
                for local, device in enumerate(devices):
                    with self.cupy.cuda.Device(device):
                        self.comms.append(self.nccl.Communicator.init(self.world_size, self.global_rank(local), uid))
            finally:
                self.nccl.group_end()
        except Exception as e:
            self.abort(f"ncclCommInitRank failed: {_nccl_message(self.nccl, e)}")
            raise XtrainError(f"NCCL could not form the world of {self.world_size} ranks: "
                              f"{_nccl_message(self.nccl, e)}") from None
        self.handles = [self.raw.Comm(c.ptr) for c in self.comms]  # non-owning: what the bindings take
        self.pending = [collections.deque() for _ in devices]     # (event, started, what) per rank
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="nccl-watchdog", daemon=True)
        self._watchdog.start()

    def global_rank(self, local: int) -> int:
        return self.launch.process_rank * self.local_world + local

    def communicator(self, local: int, stream=None) -> "NcclCommunicator":
        return NcclCommunicator(self, local, stream)

    # ---------------------------------------------------------------- failure
    def abort(self, reason: str) -> None:
        """Abort every communicator of this process (ncclCommAbort); later collectives raise CommAborted."""
        with self._lock:
            if self.abort_reason is None:
                self.abort_reason = reason
            comms, self.comms = self.comms + [c for _, c in self.groups], []
            self.groups = []
        for comm in comms:
            with contextlib.suppress(Exception):  # already broken: nothing more to release
                comm.abort()

    def _watch(self) -> None:
        success, in_progress = int(self.raw.Result.Success), int(self.raw.Result.InProgress)
        while not self._closed.wait(WATCHDOG_PERIOD_S) and self.abort_reason is None:
            for local, comm in list(enumerate(self.comms)) + list(self.groups):
                try:
                    status = int(comm.get_async_error())
                except Exception:
                    continue  # aborted or closed meanwhile
                if status not in (success, in_progress):
                    detail = self.nccl.get_error_string(status)
                    try:
                        last = comm.get_last_error()
                    except Exception:
                        last = ""
                    self.abort(f"NCCL error on rank {self.global_rank(local)}: {detail}"
                               + (f" ({last})" if last else ""))
                    return
                oldest = _oldest_unfinished(self.pending[local])
                if oldest is not None and time.monotonic() - oldest[1] > self.timeout_s:
                    self.abort(f"rank {self.global_rank(local)}'s NCCL {oldest[2]} did not complete within "
                               f"{self.timeout_s:g} s: a peer rank is stuck or dead")
                    return

    def close(self) -> None:
        """End the communicators cleanly (finalize in one group, as several ranks share this thread)."""
        self._closed.set()
        with self._lock:
            comms, self.comms = [c for _, c in self.groups] + self.comms, []  # groups end before their parent
            self.groups = []
        if not comms:
            return
        try:
            self.nccl.group_start()
            try:
                for comm in comms:
                    comm.finalize()
            finally:
                self.nccl.group_end()
            for comm in comms:
                comm.destroy()
        except Exception:
            for comm in comms:
                with contextlib.suppress(Exception):
                    comm.abort()


class NcclCommunicator:
    """One rank thread's view: the Communicator protocol over CuPy arrays on this rank's device."""

    def __init__(self, world: NcclWorld, local: int, stream=None, group=None):
        """group: an nccl.core Communicator split off the world (None: the world's own)."""
        self.world, self.local = world, local
        self.nccl_comm = group
        if group is None:
            self.rank, self.world_size = world.global_rank(local), world.world_size
        else:
            self.rank, self.world_size = int(group.rank), int(group.nranks)
        self.handle = world.handles[local] if group is None else world.raw.Comm(group.ptr)
        self.device = world.devices[local]
        self.stream = stream  # a cupy Stream, or None: the calling thread's current stream

    def _args(self, buf, dtype, stream):
        if self.world.abort_reason is not None:
            raise CommAborted(f"aborted: {self.world.abort_reason}")
        if not buf.flags.c_contiguous:
            raise ValueError("communicator buffers must be contiguous")
        name = dtype or buf.dtype.name
        if name not in self.world.dtypes:
            raise ValueError(f"NCCL collectives here take {', '.join(self.world.dtypes)}, not {name}")
        stream = stream if stream is not None else self.stream
        if stream is None:  # the calling rank thread's current stream: the one its compute runs on
            stream = self.world.cupy.cuda.get_current_stream()
        return int(self.world.dtypes[name]), stream

    def _run(self, what: str, call, stream) -> None:
        """Enqueue one NCCL call; turn an NCCL error into CommAborted for every rank of this process."""
        cupy = self.world.cupy
        # queued into a CUDA graph being captured (train/graph.py): nothing runs now, and an event recorded
        # in a capture cannot be queried (cudaErrorCapturedEvent), so the watchdog does not watch it
        captured = stream.is_capturing()
        try:
            with cupy.cuda.Device(self.device):
                call(self.handle)
                if captured:
                    return
                event = cupy.cuda.Event(disable_timing=True)
                event.record(stream)
        except Exception as e:
            if self.world.abort_reason is not None:
                raise CommAborted(f"{what} aborted: {self.world.abort_reason}") from None
            reason = f"NCCL {what} failed on rank {self.rank}: {_nccl_message(self.world.nccl, e)}"
            self.world.abort(reason)
            raise CommAborted(reason) from None
        self.world.pending[self.local].append((event, time.monotonic(), what))

    def all_reduce(self, buf, *, dtype: str | None = None, stream=None) -> None:
        data_type, s = self._args(buf, dtype, stream)
        ptr, raw = buf.data.ptr, self.world.raw
        self._run("all_reduce", lambda h: raw.all_reduce(ptr, ptr, buf.size, data_type, int(self.world.nccl.SUM),
                                                         h, s.ptr), s)

    def reduce_scatter(self, send, recv, counts=None, *, dtype: str | None = None, stream=None) -> None:
        """Equal shares: ncclReduceScatter; unequal ones (counts): one ncclReduce per rank to its owner,
        in one group. recv may be send's own share (in place)."""
        data_type, s = self._args(send, dtype, stream)
        offsets = rank_share_offsets(send.size, self.world_size, self.rank, counts, recv.size, "recv")
        sizes = [offsets[r + 1] - offsets[r] for r in range(self.world_size)]
        raw, nccl, item, sum_op = self.world.raw, self.world.nccl, send.dtype.itemsize, int(self.world.nccl.SUM)

        def call(h):
            if counts is None:
                return raw.reduce_scatter(send.data.ptr, recv.data.ptr, recv.size, data_type, sum_op, h, s.ptr)
            nccl.group_start()
            try:
                for r, size in enumerate(sizes):
                    if size:
                        raw.reduce(send.data.ptr + offsets[r] * item, recv.data.ptr, size, data_type, sum_op, r,
                                   h, s.ptr)
            finally:
                nccl.group_end()

        self._run("reduce_scatter", call, s)

    def all_gather(self, send, recv, counts=None, *, dtype: str | None = None, stream=None) -> None:
        """Equal shares: ncclAllGather; unequal ones (counts): one ncclBroadcast per rank from its owner,
        in one group. send may be recv's own share (in place)."""
        data_type, s = self._args(send, dtype, stream)
        offsets = rank_share_offsets(recv.size, self.world_size, self.rank, counts, send.size, "send")
        sizes = [offsets[r + 1] - offsets[r] for r in range(self.world_size)]
        raw, nccl, cupy, item = self.world.raw, self.world.nccl, self.world.cupy, recv.dtype.itemsize
        mine = recv.data.ptr + offsets[self.rank] * item

        def call(h):
            if counts is None:
                return raw.all_gather(send.data.ptr, recv.data.ptr, send.size, data_type, h, s.ptr)
            if send.data.ptr != mine and send.size:  # put this rank's share in place first, in stream order
                cupy.cuda.runtime.memcpyAsync(mine, send.data.ptr, send.size * item, 3, s.ptr)  # 3: device to device
            nccl.group_start()
            try:
                for r, size in enumerate(sizes):
                    if size:
                        share = recv.data.ptr + offsets[r] * item
                        raw.broadcast(share, share, size, data_type, r, h, s.ptr)
            finally:
                nccl.group_end()

        self._run("all_gather", call, s)

    def broadcast(self, buf, root: int = 0, *, dtype: str | None = None, stream=None) -> None:
        data_type, s = self._args(buf, dtype, stream)
        ptr, raw = buf.data.ptr, self.world.raw
        self._run("broadcast", lambda h: raw.broadcast(ptr, ptr, buf.size, data_type, root, h, s.ptr), s)

    def barrier(self) -> None:
        """An all-reduce of one element, waited for on the host."""
        cupy = self.world.cupy
        with cupy.cuda.Device(self.device):
            token = cupy.zeros(1, cupy.float32)
            self.all_reduce(token)
            self.synchronize()

    def synchronize(self) -> None:
        """Wait on the host for this rank's collectives, without ever waiting forever: the watchdog
        aborts a stuck one, which releases the stream."""
        queue = self.world.pending[self.local]
        try:
            newest = queue[-1][0]
        except IndexError:  # nothing pending (the watchdog may have retired it meanwhile)
            newest = None
        while newest is not None and not newest.done:  # stream order: the newest done means all done
            if self.world.abort_reason is not None:
                raise CommAborted(f"aborted: {self.world.abort_reason}")
            time.sleep(0.0002)
        if self.world.abort_reason is not None:
            raise CommAborted(f"aborted: {self.world.abort_reason}")

    # ---------------------------------------------------------------- groups
    def split(self, color: int, key: int | None = None) -> "NcclCommunicator":
        """ncclCommSplit. First a barrier, watched by the watchdog: every rank is then at the split, which
        blocks until all are (a rank that never came would leave it waiting with no timeout), and no
        operation is in flight, as ncclCommSplit requires. The group shares the world's watchdog and
        abort: a failure anywhere aborts every communicator."""
        check_split(color, key)
        self.barrier()
        parent = self.nccl_comm
        if parent is None:
            with self.world._lock:
                parent = self.world.comms[self.local] if self.world.comms else None
        if parent is None:
            raise CommAborted(f"split aborted: {self.world.abort_reason}")
        try:
            with self.world.cupy.cuda.Device(self.device):
                group = parent.split(color, self.rank if key is None else key)
        except Exception as e:
            reason = f"ncclCommSplit failed on rank {self.rank}: {_nccl_message(self.world.nccl, e)}"
            self.world.abort(reason)
            raise CommAborted(reason) from None
        with self.world._lock:
            self.world.groups.append((self.local, group))
        return NcclCommunicator(self.world, self.local, self.stream, group)

    # ---------------------------------------------------------------- point-to-point
    def send(self, buf, peer: int, *, dtype: str | None = None, stream=None) -> None:
        """ncclSend, enqueued on the rank's stream (the peer's matching recv completes it)."""
        check_peer(self, peer)
        data_type, s = self._args(buf, dtype, stream)
        raw = self.world.raw
        self._run("send", lambda h: raw.send(buf.data.ptr, buf.size, data_type, peer, h, s.ptr), s)

    def recv(self, buf, peer: int, *, dtype: str | None = None, stream=None) -> None:
        check_peer(self, peer)
        data_type, s = self._args(buf, dtype, stream)
        raw = self.world.raw
        self._run("recv", lambda h: raw.recv(buf.data.ptr, buf.size, data_type, peer, h, s.ptr), s)

    def sendrecv(self, send, dest: int, recv, source: int, *, dtype: str | None = None, stream=None) -> None:
        """ncclSend and ncclRecv in one group: NCCL starts both together, so a ring of them cannot deadlock."""
        check_peer(self, dest)
        check_peer(self, source)
        data_type, s = self._args(send, dtype, stream)
        raw, nccl = self.world.raw, self.world.nccl

        def call(h):
            nccl.group_start()
            try:
                raw.send(send.data.ptr, send.size, data_type, dest, h, s.ptr)
                raw.recv(recv.data.ptr, recv.size, data_type, source, h, s.ptr)
            finally:
                nccl.group_end()

        self._run("sendrecv", call, s)

    def abort(self, reason: str) -> None:
        self.world.abort(reason)


def _oldest_unfinished(queue):
    """Retire finished collectives from the front of a rank's queue; return the oldest still running.
    The rank thread appends while the watchdog pops: deque's append and popleft are atomic."""
    while True:
        try:
            oldest = queue[0]
        except IndexError:
            return None
        if not oldest[0].done:
            return oldest
        queue.popleft()


def _nccl_message(nccl, err: BaseException) -> str:
    """NCCL's own words for an error: the binding's message names the result code and its string."""
    text = str(err).strip() or type(err).__name__
    status = getattr(err, "status", None)
    if status is not None and "nccl" not in text.lower():
        with contextlib.suppress(Exception):
            text = f"{text}: {nccl.get_error_string(status)}"
    return text


def open_nccl_world(launch, local_world: int, devices: list[int] | None, *, timeout_s: float = 300.0,
                    rdzv_bind=None, rdzv_advertise=None, rdzv_timeout_s: float = 300.0, fingerprint: bytes = b"",
                    log=print) -> NcclWorld:
    nccl, _, cupy = nccl_modules()
    count = visible_gpus(cupy)
    if count == 0:
        raise XtrainError("--comm nccl needs a CUDA GPU, and this machine shows none "
                          "(no driver, or CUDA_VISIBLE_DEVICES hides them)")
    if devices is None:
        from .launch_env import gpu_for
        devices = [gpu_for(launch, local_world, local, count) for local in range(local_world)]
    if len(set(devices)) != len(devices):
        raise XtrainError(f"NCCL refuses two ranks on one GPU in one process (devices {devices})")
    unique_id = bytes(nccl.get_unique_id().as_bytes) if launch.process_rank == 0 else bytes(128)
    if launch.multi_process:
        if launch.kind == "mpirun":
            import numpy as np

            from .mpi import mpi_module
            buf = np.frombuffer(bytearray(unique_id), np.uint8)
            mpi_module().COMM_WORLD.Bcast(buf, root=0)
            unique_id = buf.tobytes()
        else:
            from .rendezvous import close_all, rendezvous
            unique_id, conns = rendezvous(launch, unique_id, bind=rdzv_bind, advertise=rdzv_advertise,
                                          timeout_s=rdzv_timeout_s, fingerprint=fingerprint, log=log)
            close_all(conns)  # NCCL makes its own connections from the id
    return NcclWorld(launch, local_world, devices, unique_id, timeout_s)
