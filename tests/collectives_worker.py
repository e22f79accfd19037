"""One process of a multi-process collectives check (run by test_multiprocess.py, not by pytest itself).

    python tests/collectives_worker.py ENGINE [THREADS]

ENGINE is mpi (under mpirun) or tcp (with torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT);
mpi-tests-per-exchange (under mpirun) counts the MPI communicator's Tests instead (tests_per_exchange).
Every rank checks its results against the rank-order sums it computes itself from every rank's
(seeded) data, bit for bit, and prints one line: OK and a digest of everything it received.
"""

import hashlib
import inspect
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xtrain_dist.comm.launch_env import detect_launch
from xtrain_dist.comm.local import LocalCommunicator
from xtrain_dist.comm.world import open_world
from xtrain_dist.train.launch import run_thread_ranks


def rank_data(rank, n):
    return np.random.default_rng([n, rank]).standard_normal(n).astype(np.float32)


def expected_sum(n, world, threads):
    """Each process sums its threads in order, then the processes' sums are added in process order:
    ((r0 + r1) + (r2 + r3)) for 2 x 2; the plain ((r0 + r1) + r2) + ... for one thread per process."""
    total = None
    for p in range(world // threads):
        part = rank_data(p * threads, n)
        for r in range(p * threads + 1, (p + 1) * threads):
            part = part + rank_data(r, n)
        total = part if total is None else total + part
    return total


def check(rank, comm, threads):
    world, digest = comm.world_size, hashlib.sha256()
    for n in (1, 7, 1000, 4099):  # sizes that do and do not divide by the world
        buf = rank_data(rank, n)
        comm.all_reduce(buf)
        digest.update(buf.tobytes())
        assert buf.tobytes() == expected_sum(n, world, threads).tobytes(), \
            f"rank {rank}: all_reduce of {n} is not the rank-order sum"
    n = 5
    shard = np.empty(n, np.float32)
    comm.reduce_scatter(rank_data(rank, n * world), shard)
    total = sum(rank_data(r, n * world) for r in range(world))
    np.testing.assert_allclose(shard, total[rank * n:(rank + 1) * n], rtol=1e-6)
    # unequal shares (ZeRO-1's shards), rank 1 owning none, in place and not
    counts = [(r % 3) * 2 + (r == 0) for r in range(world)]
    counts[1 % world] = 0
    bounds = np.cumsum([0, *counts])
    if threads == 1 or "counts" in inspect.signature(LocalCommunicator.all_gather).parameters:
        send = rank_data(rank, int(bounds[-1]))
        mine = send[bounds[rank]:bounds[rank + 1]]
        comm.reduce_scatter(send, mine, counts)  # in place: recv is send's own share
        total = expected_sum(int(bounds[-1]), world, threads)
        assert mine.tobytes() == total[bounds[rank]:bounds[rank + 1]].tobytes(), f"rank {rank}: reduce_scatter"
        everyone = np.full(int(bounds[-1]), np.nan, np.float32)
        comm.all_gather(np.full(counts[rank], rank, np.float32), everyone, counts)
        assert everyone.tolist() == [float(r) for r in range(world) for _ in range(counts[r])], everyone
        everyone[bounds[rank]:bounds[rank + 1]] = -rank
        comm.all_gather(everyone[bounds[rank]:bounds[rank + 1]], everyone, counts)  # in place
        assert everyone.tolist() == [-float(r) for r in range(world) for _ in range(counts[r])], everyone
    gathered = np.empty(3 * world, np.float32)
    comm.all_gather(np.full(3, rank, np.float32), gathered)
    assert gathered.tolist() == [float(r) for r in range(world) for _ in range(3)], gathered
    for root in (0, world - 1):
        b = np.full(4, rank, np.float32)
        comm.broadcast(b, root=root)
        assert (b == root).all(), (rank, root, b)
    comm.barrier()
    return digest.hexdigest()


def tests_per_exchange():
    """A 16 MiB all-reduce and reduce-scatter with a 10 ms nap before every Test that finds them pending:
    the exchange must finish in a few Tests whatever its size, not in one Test per few KiB (MPICH's
    Ialltoallv needs about a thousand here). Prints how many Tests found them pending."""
    from xtrain_dist.comm import mpi
    mpi.SPIN_POLLS, mpi.NAP_S = 0, 0.01
    comm = mpi.MpiCommunicator(timeout_s=60)
    rank, world, n = comm.rank, comm.world_size, 4 << 20
    comm.barrier()
    before = comm.unfinished_tests
    buf = np.full(n, rank + 1, np.float32)
    comm.all_reduce(buf)
    assert (buf == world * (world + 1) // 2).all(), f"rank {rank}: all_reduce"
    shard = np.empty(n // world, np.float32)
    comm.reduce_scatter(np.arange(n, dtype=np.float32), shard)
    assert shard.tobytes() == (world * np.arange(n, dtype=np.float32)[rank * shard.size:][:shard.size]).tobytes()
    sys.stdout.write(f"PENDING {rank} {comm.unfinished_tests - before}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "mpi-tests-per-exchange":
        tests_per_exchange()
        sys.exit()
    engine, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    launch = detect_launch()
    world = open_world(engine, launch=launch, local_world=threads, timeout_s=60, rdzv_timeout_s=60)
    digests = run_thread_ranks(threads, lambda local, comm: check(comm.rank, comm, threads), group=world)
    world.close()
    # one write, one line: with several processes on one pipe, print's separate writes would interleave
    sys.stdout.write(f"OK {launch.process_rank} {' '.join(digests)}\n")
    sys.stdout.flush()
