"""One process of a multi-process check of groups, point-to-point and the ring (run by test_groups.py).

    python tests/groups_worker.py ENGINE [CASE]

ENGINE is mpi (under mpirun) or tcp (torchrun-style variables). CASE `check` (the default) runs every
check and prints `OK rank digest`; `mismatch` has rank 0 send 5 floats where rank 1 receives 4, and
`silent` has rank 1 wait for a message rank 0 never sends: both must end every process with one line.
`dead`: rank 2 dies after a split; rank 0 waits for it on the world, rank 1 waits in its group for rank 0,
and both must end at once, not at the timeout.
"""

import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xtrain_dist.comm.launch_env import detect_launch
from xtrain_dist.comm.mesh import DeviceMesh
from xtrain_dist.comm.ring import ring_all_reduce, ring_chunks
from xtrain_dist.comm.world import open_world
from xtrain_dist.train.launch import run_thread_ranks


def rank_data(rank, n):
    return np.random.default_rng([n, rank]).standard_normal(n).astype(np.float32) * np.float32(10.0 ** rank)


def ring_oracle(ranks, n):
    out = np.empty(n, np.float32)
    for c, (lo, hi) in enumerate(ring_chunks(n, len(ranks))):
        total = rank_data(ranks[c], n)[lo:hi]
        for step in range(1, len(ranks)):
            total = total + rank_data(ranks[(c + step) % len(ranks)], n)[lo:hi]
        out[lo:hi] = total
    return out


def check(rank, comm):
    world, digest = comm.world_size, hashlib.sha256()
    # point-to-point on the world: every rank sends its number to the next and receives the previous's
    got = np.empty(3, np.float32)
    comm.sendrecv(np.full(3, rank, np.float32), (rank + 1) % world, got, (rank - 1) % world)
    assert got.tolist() == [float((rank - 1) % world)] * 3, got
    if rank == 0:  # a plain send and recv between two ranks other than through rank 0
        comm.recv(got, world - 1)
        assert got.tolist() == [7.0] * 3, got
    elif rank == world - 1:
        comm.send(np.full(3, 7.0, np.float32), 0)
    # the ring on the world, sizes below and not divisible by the world
    for n in (1, 2, 7, 4099):
        buf = rank_data(rank, n)
        ring_all_reduce(comm, buf)
        assert buf.tobytes() == ring_oracle(list(range(world)), n).tobytes(), f"rank {rank}: ring of {n}"
        digest.update(buf.tobytes())
    # groups: evens and odds in reverse order, with collectives, point-to-point and the ring on them
    group = comm.split(rank % 2, key=-rank)
    members = sorted((r for r in range(world) if r % 2 == rank % 2), reverse=True)
    assert (group.rank, group.world_size) == (members.index(rank), len(members))
    buf = rank_data(rank, 5)
    group.all_reduce(buf)
    expected = rank_data(members[0], 5)
    for r in members[1:]:
        expected = expected + rank_data(r, 5)
    assert buf.tobytes() == expected.tobytes(), f"rank {rank}: group all_reduce"
    if group.world_size > 1:
        buf = rank_data(rank, 11)
        ring_all_reduce(group, buf)
        assert buf.tobytes() == ring_oracle(members, 11).tobytes(), f"rank {rank}: group ring"
        digest.update(buf.tobytes())
    if world % 2 == 0:  # the mesh's tp group sums only within it
        mesh = DeviceMesh(comm, dp=world // 2, tp=2)
        pair = np.array([10.0 ** rank])
        mesh.tp.all_reduce(pair)
        assert pair[0] == 10.0 ** (rank - rank % 2) * 11, pair
    comm.barrier()
    return digest.hexdigest()


def mismatch(rank, comm):
    if rank == 0:
        comm.send(np.zeros(5, np.float32), 1)
        comm.barrier()
    elif rank == 1:
        comm.recv(np.empty(4, np.float32), 0)


def silent(rank, comm):
    if rank == 1:
        comm.recv(np.empty(4, np.float32), 0)
    else:
        time.sleep(3)  # alive and busy past rank 1's timeout, then finds the job aborted
        comm.barrier()


def dead(rank, comm):
    group = comm.split(0 if rank < 2 else 1)
    if rank == 2:
        os._exit(3)  # no goodbye: its sockets close with the process
    if rank == 0:
        comm.barrier()  # waits for rank 2
    else:
        group.recv(np.empty(1, np.float32), 0)  # rank 0 never sends: released when rank 0 aborts


if __name__ == "__main__":
    engine, case = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "check"
    launch = detect_launch()
    world = open_world(engine, launch=launch, local_world=1, timeout_s=float(sys.argv[3]) if len(sys.argv) > 3
                       else 60, rdzv_timeout_s=60)
    body = {"check": check, "mismatch": mismatch, "silent": silent, "dead": dead}[case]
    try:
        digests = run_thread_ranks(1, lambda local, comm: body(comm.rank, comm), group=world)
    except Exception as e:  # one line, and the other processes end too
        sys.stderr.write(f"rank {launch.process_rank}: {getattr(e, 'error', e)}\n")
        sys.stderr.flush()
        world.abort("failed")
        if engine == "mpi":
            from xtrain_dist.comm.mpi import abort_job
            abort_job(1)
        sys.exit(1)
    world.close()
    sys.stdout.write(f"OK {launch.process_rank} {digests[0]}\n")
    sys.stdout.flush()
