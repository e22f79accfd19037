"""One process of a multi-process NCCL check (run by test_nccl.py and bin/gpu_session/nccl.sh).

    python tests/nccl_worker.py probe | collectives | loop | bench [MAX_MIB]

Started torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the NCCL id travels through the
TCP rendezvous. Two processes may share one GPU when each has its own NCCL_HOSTID (NCCL then takes
them for two hosts and connects them through its socket transport).
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xtrain_dist.comm.launch_env import detect_launch
from xtrain_dist.comm.world import open_world


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def rank_data(rank, n):
    return np.random.default_rng([n, rank]).standard_normal(n).astype(np.float32)


def say(line: str) -> None:
    """One write per line: several processes share the pipe, and print's separate writes interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(mode: str, arg: str | None) -> None:
    import cupy

    launch = detect_launch()
    world = open_world("nccl", launch=launch, local_world=1, timeout_s=60, rdzv_timeout_s=120)
    comm = world.communicator(0)
    rank, size = comm.rank, comm.world_size
    if mode == "probe":
        buf = cupy.full(4, rank + 1, cupy.float32)
        comm.all_reduce(buf)
        comm.synchronize()
        assert buf.get().tolist() == [size * (size + 1) / 2] * 4, buf.get()
        say(f"OK probe {rank}")
    elif mode == "collectives":
        out = {}
        for n in (1, 1000, 1 << 20):
            buf = cupy.asarray(rank_data(rank, n))
            comm.all_reduce(buf)
            got = buf.get()
            np.testing.assert_allclose(got, sum(rank_data(r, n) for r in range(size)), rtol=1e-5, atol=1e-6)
            bf = cupy.asarray(to_bf16_bits(rank_data(rank, n)))
            comm.all_reduce(bf, dtype="bf16")
            exact = sum(from_bf16_bits(to_bf16_bits(rank_data(r, n))) for r in range(size))
            np.testing.assert_allclose(from_bf16_bits(bf.get()), exact, rtol=2e-2, atol=2e-2)
            out[n] = [got.tobytes().hex()[:64], bf.get().tobytes().hex()[:64]]
        shard = cupy.empty(5, cupy.float32)
        comm.reduce_scatter(cupy.asarray(rank_data(rank, 5 * size)), shard)
        total = sum(rank_data(r, 5 * size) for r in range(size))
        np.testing.assert_allclose(shard.get(), total[rank * 5:(rank + 1) * 5], rtol=1e-5)
        gathered = cupy.empty(3 * size, cupy.float32)
        comm.all_gather(cupy.full(3, rank, cupy.float32), gathered)
        assert gathered.get().tolist() == [float(r) for r in range(size) for _ in range(3)]
        b = cupy.full(4, rank, cupy.float32)
        comm.broadcast(b, root=size - 1)
        assert (b.get() == size - 1).all()
        comm.barrier()
        # every rank prints the bits it received: the test checks they agree across ranks
        say(f"OK collectives {rank} {json.dumps(out, sort_keys=True)}")
    elif mode == "loop":  # for the kill test: runs until a peer dies, then must fail, not hang
        buf = cupy.ones(1 << 20, cupy.float32)
        say(f"LOOPING {rank}")
        while True:
            comm.all_reduce(buf)
            comm.synchronize()
            buf.fill(1)
    elif mode == "bench":
        max_bytes = int(float(arg or 256) * (1 << 20))
        rows, nbytes = [], 4096
        while nbytes <= max_bytes:
            buf = cupy.ones(nbytes // 4, cupy.float32)
            for _ in range(3):
                comm.all_reduce(buf)
            comm.synchronize()
            iters = max(3, min(200, int(2e9 // max(nbytes, 1) // 64)))
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(buf)
            comm.synchronize()
            seconds = (time.perf_counter() - t0) / iters
            algbw = nbytes / seconds / 1e9
            rows.append({"bytes": nbytes, "us": seconds * 1e6, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * 2 * (size - 1) / size})
            nbytes *= 4
        if rank == 0:
            say(f"BENCH {json.dumps({'world': size, 'rows': rows})}")
    world.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
