"""The NCCL communicator's own logic on the CPU, against a stand-in for nccl4py and CuPy that records
every call: one group around the CommInitRank calls of a process's threads, global ranks and devices,
the pointers, counts, types and streams handed to NCCL, and collective abort with NCCL's error string
on an async error, a failed call or a timeout. The real library runs in tests/test_nccl.py (GPU)."""

import contextlib
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from xtrain_dist.comm import CommAborted
from xtrain_dist.comm import nccl as nccl_module
from xtrain_dist.comm.launch_env import Launch


class FakeComm:
    def __init__(self, log, nranks, rank, device):
        self.log, self.nranks, self.rank, self.device = log, nranks, rank, device
        self.ptr = 1000 + rank
        self.async_error = 0
        self.aborted = False

    def get_async_error(self):
        return self.async_error

    def get_last_error(self):
        return "socket closed by peer"

    def abort(self):
        self.aborted = True
        self.log.append(("abort", self.rank))

    def finalize(self):
        self.log.append(("finalize", self.rank))

    def destroy(self):
        self.log.append(("destroy", self.rank))


def stream(ptr: int) -> SimpleNamespace:
    """A CuPy stream as the communicator sees it: its handle, and never capturing (train/graph.py)."""
    return SimpleNamespace(ptr=ptr, is_capturing=lambda: False)


class Fake:
    """nccl.core, nccl.bindings.nccl and cupy, as far as the communicator uses them."""

    def __init__(self):
        self.log, self.in_group, self.current_device = [], False, 0
        self.comms, self.events_done, self.fail_next_call = [], True, None
        self.current_stream = 0  # the calling thread's current stream (the null stream until set)
        fake = self

        class Communicator:
            @staticmethod
            def init(nranks, rank, uid):
                fake.log.append(("init", rank, fake.current_device, fake.in_group, uid))
                comm = FakeComm(fake.log, nranks, rank, fake.current_device)
                fake.comms.append(comm)
                return comm

        class Device:
            def __init__(self, device):
                self.device = device

            def __enter__(self):
                self.saved, fake.current_device = fake.current_device, self.device

            def __exit__(self, *exc):
                fake.current_device = self.saved

        class Event:
            def __init__(self, disable_timing=True):
                self.done = fake.events_done

            def record(self, stream=None):
                pass

        def collective(name):
            def call(*args):
                if fake.fail_next_call:
                    raise RuntimeError(fake.fail_next_call)
                fake.log.append((name, *args))
            return call

        self.nccl = SimpleNamespace(
            Communicator=Communicator, UniqueId=SimpleNamespace(from_bytes=lambda b: ("uid", b[:4])),
            group_start=lambda: setattr(fake, "in_group", True) or fake.log.append(("group_start",)),
            group_end=lambda: setattr(fake, "in_group", False) or fake.log.append(("group_end",)),
            get_error_string=lambda status: {6: "remote process exited or there was a network error"}[status],
            get_unique_id=lambda: SimpleNamespace(as_bytes=b"ID" * 64),
            FLOAT32=7, BFLOAT16=9, FLOAT16=6, FLOAT64=8, INT32=2, INT64=4, UINT8=1, SUM=0)
        self.raw = SimpleNamespace(
            Comm=lambda ptr: ("handle", ptr), Result=SimpleNamespace(Success=0, InProgress=7),
            all_reduce=collective("all_reduce"), reduce_scatter=collective("reduce_scatter"),
            all_gather=collective("all_gather"), broadcast=collective("broadcast"), reduce=collective("reduce"))
        self.cupy = SimpleNamespace(cuda=SimpleNamespace(
            Device=Device, Event=Event, get_current_stream=lambda: stream(fake.current_stream),
            runtime=SimpleNamespace(getDeviceCount=lambda: 4,
                                    memcpyAsync=lambda *args: fake.log.append(("memcpy", *args)))))


class Buf:
    """The attributes of a CuPy array that the communicator reads."""

    def __init__(self, n, dtype="float32", ptr=0xABC0):
        self.size, self.dtype, self.data = n, np.dtype(dtype), SimpleNamespace(ptr=ptr)
        self.flags = SimpleNamespace(c_contiguous=True)


@pytest.fixture
def fake(monkeypatch):
    fake = Fake()
    monkeypatch.setattr(nccl_module, "nccl_modules", lambda: (fake.nccl, fake.raw, fake.cupy))
    monkeypatch.setattr(nccl_module, "WATCHDOG_PERIOD_S", 0.01)
    return fake


def world_of(fake, process_rank=1, processes=2, threads=2, timeout_s=300.0):
    launch = Launch("torchrun", process_rank=process_rank, num_processes=processes, local_rank=process_rank)
    return nccl_module.NcclWorld(launch, threads, devices=[2, 3], unique_id=b"ID" * 64, timeout_s=timeout_s)


def wait_for(condition, seconds=10.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_threads_of_a_process_init_in_one_group_on_their_own_devices(fake):
    world = world_of(fake)
    inits = [entry for entry in fake.log if entry[0] == "init"]
    assert fake.log[0] == ("group_start",) and fake.log[len(inits) + 1] == ("group_end",)
    # process 1 of 2 with 2 threads hosts global ranks 2 and 3; each init runs on its thread's device
    assert [(rank, device, in_group) for _, rank, device, in_group, _ in inits] == [(2, 2, True), (3, 3, True)]
    assert all(comm.nranks == 4 for comm in fake.comms)
    comms = [world.communicator(local) for local in range(2)]
    assert [(c.rank, c.world_size, c.device) for c in comms] == [(2, 4, 2), (3, 4, 3)]
    fake.log.clear()
    world.close()
    # the ranks share this thread: their finalizes in one group, as their inits
    assert fake.log == [("group_start",), ("finalize", 2), ("finalize", 3), ("group_end",), ("destroy", 2),
                        ("destroy", 3)]


def test_collectives_hand_nccl_pointers_counts_types_and_the_stream(fake):
    world = world_of(fake)
    comm = world.communicator(0)
    comm.all_reduce(Buf(10))
    comm.all_reduce(Buf(6, "uint16", ptr=0x100), dtype="bf16", stream=stream(0x5555))
    fake.current_stream = 0x7777  # the CUDA backend made the rank's own stream current
    comm.all_reduce(Buf(1, ptr=0x10))
    fake.current_stream = 0
    comm.reduce_scatter(Buf(8, ptr=0x200), Buf(2, ptr=0x300))
    comm.all_gather(Buf(2, ptr=0x300), Buf(8, ptr=0x200))
    comm.broadcast(Buf(3, ptr=0x400), root=1)
    handle = ("handle", 1002)
    assert [e for e in fake.log if e[0] in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")] == [
        ("all_reduce", 0xABC0, 0xABC0, 10, 7, 0, handle, 0),            # in place, fp32, sum, null stream
        ("all_reduce", 0x100, 0x100, 6, 9, 0, handle, 0x5555),          # bf16 carried in uint16, a given stream
        ("all_reduce", 0x10, 0x10, 1, 7, 0, handle, 0x7777),            # the thread's current stream
        ("reduce_scatter", 0x200, 0x300, 2, 7, 0, handle, 0),           # count = recv's
        ("all_gather", 0x300, 0x200, 2, 7, handle, 0),                  # count = send's
        ("broadcast", 0x400, 0x400, 3, 7, 1, handle, 0)]
    with pytest.raises(ValueError, match="NCCL collectives here take float32, bfloat16, bf16"):
        comm.all_reduce(Buf(4, "uint16"))  # no silent reinterpretation of raw bits
    world.close()


def test_unequal_shares_are_one_group_of_reduces_or_broadcasts(fake):
    world = world_of(fake)  # world 4, this is rank 2 (local 0)
    comm = world.communicator(0)
    handle, counts = ("handle", 1002), [3, 0, 4, 1]  # rank 1 owns nothing
    fake.log.clear()
    comm.reduce_scatter(Buf(8, ptr=0x1000), Buf(4, ptr=0x1000 + 3 * 4), counts)  # in place: recv is the share
    assert [e for e in fake.log if e[0] != "init"] == [
        ("group_start",),
        ("reduce", 0x1000, 0x100C, 3, 7, 0, 0, handle, 0),
        ("reduce", 0x100C, 0x100C, 4, 7, 0, 2, handle, 0),
        ("reduce", 0x101C, 0x100C, 1, 7, 0, 3, handle, 0),
        ("group_end",)]
    fake.log.clear()
    comm.all_gather(Buf(4, ptr=0x9000), Buf(8, ptr=0x2000), counts)  # not in place: the share is copied first
    assert fake.log == [
        ("memcpy", 0x200C, 0x9000, 16, 3, 0), ("group_start",),
        ("broadcast", 0x2000, 0x2000, 3, 7, 0, handle, 0),
        ("broadcast", 0x200C, 0x200C, 4, 7, 2, handle, 0),
        ("broadcast", 0x201C, 0x201C, 1, 7, 3, handle, 0),
        ("group_end",)]
    fake.log.clear()
    comm.all_gather(Buf(4, ptr=0x200C), Buf(8, ptr=0x2000), counts)  # in place: no copy
    assert fake.log[0] == ("group_start",)
    with pytest.raises(ValueError, match=r"counts \[3, 0, 4\] do not split 8 elements over 4 ranks"):
        comm.all_gather(Buf(4), Buf(8), [3, 0, 4])
    with pytest.raises(ValueError, match="rank 2: recv has 2 elements, its share is 4"):
        comm.reduce_scatter(Buf(8), Buf(2), counts)
    world.close()


def test_an_async_error_aborts_every_communicator_with_nccl_s_words(fake):
    world = world_of(fake)
    comms = [world.communicator(local) for local in range(2)]
    fake.comms[1].async_error = 6  # ncclRemoteError on the second rank
    assert wait_for(lambda: all(c.aborted for c in fake.comms))
    for comm in comms:
        with pytest.raises(CommAborted) as info:
            comm.all_reduce(Buf(4))
        assert str(info.value) == ("aborted: NCCL error on rank 3: remote process exited or there was a network "
                                   "error (socket closed by peer)")


def test_a_collective_that_never_finishes_is_aborted_at_the_timeout(fake):
    world = world_of(fake, timeout_s=0.2)
    comm = world.communicator(0)
    fake.events_done = False  # the GPU never finishes: a peer is gone
    comm.all_reduce(Buf(4))
    outcome = []

    def wait():
        try:
            comm.synchronize()
            outcome.append("returned")
        except CommAborted as e:
            outcome.append(str(e))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "synchronize waited past the abort"
    assert outcome == ["aborted: rank 2's NCCL all_reduce did not complete within 0.2 s: a peer rank is stuck or dead"]
    assert world.abort_reason == "rank 2's NCCL all_reduce did not complete within 0.2 s: a peer rank is stuck or dead"
    assert all(c.aborted for c in fake.comms)


def test_a_failing_call_aborts_the_process_and_names_the_error(fake):
    world = world_of(fake)
    fake.fail_next_call = "ncclInvalidUsage: invalid usage"
    with pytest.raises(CommAborted) as info:
        world.communicator(1).all_reduce(Buf(4))
    assert str(info.value) == "NCCL all_reduce failed on rank 3: ncclInvalidUsage: invalid usage"
    assert all(c.aborted for c in fake.comms)
    with contextlib.suppress(Exception):
        world.close()


def test_rank0_makes_the_id_and_one_process_needs_no_rendezvous(fake):
    world = nccl_module.open_nccl_world(Launch("single"), 2, None)
    assert [e[4] for e in fake.log if e[0] == "init"] == [("uid", b"IDID")] * 2
    assert world.devices == [0, 1]
    world.close()


def test_two_ranks_on_one_gpu_in_one_process_is_refused(fake):
    from xtrain_dist.errors import XtrainError
    with pytest.raises(XtrainError, match=r"NCCL refuses two ranks on one GPU in one process \(devices \[0, 0\]\)"):
        nccl_module.open_nccl_world(Launch("single"), 2, [0, 0])


def test_an_operation_still_in_progress_is_not_an_error(fake):
    """ncclInProgress (a non-blocking init or abort still running) is not a failure: no abort."""
    world = world_of(fake)
    comm, polls = fake.comms[0], []
    comm.async_error = 7
    comm.get_async_error = lambda: polls.append(1) or 7
    assert wait_for(lambda: len(polls) >= 3)
    assert world.abort_reason is None and not any(c.aborted for c in fake.comms)
    world.close()


def test_finished_collectives_are_retired_and_never_time_out(fake):
    world = world_of(fake, timeout_s=0.2)
    world.communicator(0).all_reduce(Buf(4))  # the stand-in GPU finishes at once
    assert wait_for(lambda: not world.pending[0], seconds=5), "a finished collective stayed pending"
    assert world.abort_reason is None
    world.close()


def test_a_collective_queued_into_a_capture_is_called_but_not_watched(fake):
    """A collective captured into a CUDA graph (train/graph.py) is handed to NCCL as usual, but runs only
    when the graph is launched, and an event recorded in a capture cannot be queried: no event is queued
    for the watchdog, which would otherwise time it out or fail on it."""
    fake.events_done = False  # an event the watchdog did watch would never finish
    world = world_of(fake, timeout_s=0.2)
    capturing = SimpleNamespace(ptr=0x4444, is_capturing=lambda: True)
    world.communicator(0).all_reduce(Buf(4), stream=capturing)
    assert [entry for entry in fake.log if entry[0] == "all_reduce"][-1][-1] == 0x4444
    assert not world.pending[0]
    time.sleep(0.4)
    assert world.abort_reason is None
    world.close()


def test_a_failed_init_aborts_the_ranks_already_made_and_says_so(fake):
    from xtrain_dist.errors import XtrainError
    init = fake.nccl.Communicator.init

    def failing_init(nranks, rank, uid):
        if rank == 3:
            raise RuntimeError("ncclSystemError: system error")
        return init(nranks, rank, uid)

    fake.nccl.Communicator = SimpleNamespace(init=failing_init)
    with pytest.raises(XtrainError) as info:
        world_of(fake)
    assert str(info.value) == "NCCL could not form the world of 4 ranks: ncclSystemError: system error"
    assert [(c.rank, c.aborted) for c in fake.comms] == [(2, True)]


class Conn:
    def __init__(self):
        self.closed = False

    def shutdown(self, how):
        pass

    def close(self):
        self.closed = True


def test_a_process_of_several_takes_its_slice_of_the_gpus_and_rank0s_id(fake, monkeypatch):
    """Process 1 of 2 (local rank 1) with 2 threads on a node of 4 GPUs: GPUs 2 and 3; it makes no id of
    its own but takes rank 0's from the rendezvous, whose connections it then closes (NCCL makes its own)."""
    from xtrain_dist.comm import rendezvous as rendezvous_module
    conns, sent = [Conn()], []

    def rendezvous(launch, payload, **kw):
        sent.append((launch.process_rank, payload))
        return b"RZ" * 64, conns

    monkeypatch.setattr(rendezvous_module, "rendezvous", rendezvous)
    launch = Launch("torchrun", process_rank=1, num_processes=2, local_rank=1)
    world = nccl_module.open_nccl_world(launch, 2, None)
    assert world.devices == [2, 3]
    assert sent == [(1, bytes(128))]
    assert [e[1:3] + e[4:] for e in fake.log if e[0] == "init"] == [(2, 2, ("uid", b"RZRZ")), (3, 3, ("uid", b"RZRZ"))]
    assert all(c.closed for c in conns)
    world.close()


# ------------------------------------------------------------------ the stand-in against the real nccl4py
# Everything above runs against Fake; these checks keep Fake honest. nccl4py imports without a GPU (the
# test extra installs it), so every name, enum value and argument order the communicator relies on is
# checked against the real binding here, and ncclGetUniqueId (which needs libnccl but no device) runs.

def real_nccl():
    nccl = pytest.importorskip("nccl.core", reason="nccl4py is not installed")
    from nccl.bindings import nccl as raw
    return nccl, raw


def test_the_stand_in_names_and_values_are_nccl4pys():
    nccl, raw = real_nccl()
    stand_in = Fake()
    for name, value in vars(stand_in.nccl).items():
        assert hasattr(nccl, name), f"nccl.core has no {name}"
        if isinstance(value, int):
            assert int(getattr(nccl, name)) == value, name
    assert hasattr(nccl.Communicator, "init") and hasattr(nccl.UniqueId, "from_bytes")
    for method in ("abort", "finalize", "destroy", "get_async_error", "get_last_error", "ptr"):
        assert hasattr(nccl.Communicator, method), f"nccl.core.Communicator has no {method}"
    assert (int(raw.Result.Success), int(raw.Result.InProgress)) == (0, 7)
    assert nccl.get_error_string(6) == stand_in.nccl.get_error_string(6)
    assert raw.Comm(0x1234).handle == 0x1234  # a non-owning wrapper of a raw ncclComm_t


@pytest.mark.parametrize("name, args", [
    ("all_reduce", "sendbuff, recvbuff, count, datatype, op, comm, stream"),
    ("reduce_scatter", "sendbuff, recvbuff, recvcount, datatype, op, comm, stream"),
    ("all_gather", "sendbuff, recvbuff, sendcount, datatype, comm, stream"),
    ("broadcast", "sendbuff, recvbuff, count, datatype, root, comm, stream"),
    ("reduce", "sendbuff, recvbuff, count, datatype, op, root, comm, stream"),
])
def test_collectives_take_their_arguments_in_the_order_we_pass_them(name, args):
    _, raw = real_nccl()
    signature = getattr(raw, name).__doc__.splitlines()[0]  # Cython's embedded "name(type arg, ...)"
    params = [p.split()[-1].split("=")[0] for p in signature[signature.index("(") + 1:signature.rindex(")")].split(",")]
    assert params == [a.strip() for a in args.split(",")], signature


def test_unique_id_survives_the_bytes_round_trip():
    nccl, _ = real_nccl()
    try:
        uid = nccl.get_unique_id()
    except Exception as e:  # libnccl.so.2 not found: nvidia-nccl-cu13 is not installed
        pytest.skip(f"libnccl unavailable: {e}")
    wire = bytes(uid.as_bytes)  # what rank 0 sends through MPI or the TCP rendezvous
    assert len(wire) == 128 and wire != bytes(128)
    assert bytes(nccl.UniqueId.from_bytes(wire).as_bytes) == wire
