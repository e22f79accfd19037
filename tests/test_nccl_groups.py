"""Groups (ncclCommSplit) and point-to-point (ncclSend/ncclRecv) on the NCCL communicator: rank threads
of one process on one GPU each (skipped with fewer than two GPUs, or without CuPy/nccl4py). On the
CPU, XTRAIN_CUDASIM=1 XTRAIN_CUDASIM_DEVICES=4 runs it over tests/cudasim's stand-ins."""

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("nccl.core", reason="nccl4py is not installed (pip install -e '.[cuda]')")


def _gpu_count():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPUS = _gpu_count()
if GPUS < 2:
    pytest.skip("fewer than two CUDA GPUs: NCCL needs one per rank thread", allow_module_level=True)

pytestmark = pytest.mark.gpu

from groups_worker import rank_data, ring_oracle  # noqa: E402  (the same data and oracle as the CPU engines')

from xtrain_dist.comm import CommAborted  # noqa: E402
from xtrain_dist.comm.ring import ring_all_reduce  # noqa: E402
from xtrain_dist.comm.world import open_world  # noqa: E402
from xtrain_dist.train.launch import RankFailed, run_thread_ranks  # noqa: E402

WORLD = min(GPUS, 4)


def on_ranks(body):
    world = open_world("nccl", local_world=WORLD, timeout_s=30)
    try:
        return run_thread_ranks(WORLD, lambda local, comm: body(comm), group=world)
    finally:
        world.close()


def test_point_to_point_the_ring_and_groups_over_nccl():
    def body(comm):
        rank = comm.rank
        with cupy.cuda.Device(comm.device):
            got = cupy.zeros(3, cupy.float32)
            comm.sendrecv(cupy.full(3, rank, cupy.float32), (rank + 1) % WORLD, got, (rank - 1) % WORLD)
            if rank == 0:
                comm.send(cupy.full(2, 7, cupy.float32), WORLD - 1)
            if rank == WORLD - 1:
                plain = cupy.zeros(2, cupy.float32)
                comm.recv(plain, 0)
            ring = {}
            for n in (1, 7, 1001):
                buf = cupy.asarray(rank_data(rank, n))
                ring_all_reduce(comm, buf)
                ring[n] = buf
            group = comm.split(rank % 2, key=-rank)
            summed = cupy.asarray(np.array([10.0 ** rank], np.float32))
            group.all_reduce(summed)
            comm.synchronize()
            return (got.get().tolist(), plain.get().tolist() if rank == WORLD - 1 else None,
                    {n: b.get() for n, b in ring.items()}, group.rank, group.world_size, float(summed.get()[0]))

    for rank, (got, plain, ring, group_rank, group_size, summed) in enumerate(on_ranks(body)):
        assert got == [float((rank - 1) % WORLD)] * 3
        assert plain == ([7.0, 7.0] if rank == WORLD - 1 else None)
        for n, buf in ring.items():
            assert buf.tobytes() == ring_oracle(list(range(WORLD)), n).tobytes(), (rank, n)
        members = sorted((r for r in range(WORLD) if r % 2 == rank % 2), reverse=True)
        assert (group_rank, group_size) == (members.index(rank), len(members))
        assert summed == pytest.approx(sum(10.0 ** r for r in members), rel=1e-6)


def test_a_rank_that_fails_outside_a_group_aborts_the_group_too():
    def body(comm):
        group = comm.split(0 if comm.rank == 0 else 1)
        if comm.rank == 0:
            raise ValueError("rank zero broke")
        with cupy.cuda.Device(comm.device):
            got = cupy.zeros(1, cupy.float32)
            comm.recv(got, 0)  # never sent: the abort releases it
            group.synchronize()
            comm.synchronize()

    with pytest.raises(RankFailed) as info:
        on_ranks(body)
    assert info.value.rank == 0 and str(info.value.error) == "rank zero broke"


def test_a_bad_peer_is_refused_before_nccl_sees_it():
    def body(comm):
        with cupy.cuda.Device(comm.device):
            comm.send(cupy.zeros(1, cupy.float32), comm.rank)

    with pytest.raises(RankFailed) as info:
        on_ranks(body)
    assert not isinstance(info.value.error, CommAborted)
    assert str(info.value.error).endswith(f"is not another rank of this communicator (0 .. {WORLD - 1})")
