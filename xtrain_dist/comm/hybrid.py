"""Thread ranks inside process ranks: several rank threads per process, several processes per job.

Global rank g = process_rank * local_world + local. A collective is three simple ones: the threads of a
process combine among themselves (the thread communicator), thread 0 of each process (the leader) runs
the collective across processes (MPI or TCP, process ranks), and the leader's result is broadcast to
its threads. Only leaders call the process communicator, one call at a time, so MPI needs no more than
MPI_THREAD_SERIALIZED and the process communicators stay one-rank-per-process. Every rank gets identical
bits: the cross-process result is computed once per element and copied.
"""

from ..errors import XtrainError
from . import rank_share_offsets, shard_offsets

# A group or a message between rank threads of different processes would need the process communicator
# from threads other than the leader: said plainly rather than half done.
NOT_BUILT = ("groups and point-to-point across rank threads of several processes are not built: run one rank "
             "thread per process (mpirun -n N, torchrun --nproc-per-node N)")


class HybridCommunicator:
    def __init__(self, local, inter, process_rank: int, local_world: int):
        self.local, self.inter, self.local_world = local, inter, local_world
        self.rank = process_rank * local_world + local.rank
        self.world_size = inter.world_size * local_world
        self.process_rank = process_rank
        self.leader = local.rank == 0

    def all_reduce(self, buf) -> None:
        self.local.all_reduce(buf)  # every thread: this process's sum
        if self.leader:
            self.inter.all_reduce(buf)
        self.local.broadcast(buf, root=0)

    def reduce_scatter(self, send, recv, counts=None) -> None:
        # one all-reduce of a copy, then this rank's share: twice the traffic of a true reduce-scatter,
        # and obviously the same bits as all_reduce
        offsets = rank_share_offsets(send.size, self.world_size, self.rank, counts, recv.size, "recv")
        lo, hi = offsets[self.rank], offsets[self.rank + 1]
        total = send.reshape(-1).copy()
        self.all_reduce(total)
        recv.reshape(-1)[...] = total[lo:hi]

    def all_gather(self, send, recv, counts=None) -> None:
        out, procs, per = recv.reshape(-1), self.inter.world_size, self.local_world
        offsets = shard_offsets(out.size, self.world_size, counts)
        first, last = self.process_rank * per, (self.process_rank + 1) * per
        block = out[offsets[first]:offsets[last]]  # this process's ranks are contiguous in the global order
        if counts is None:
            self.local.all_gather(send, block)
        else:  # unequal shares need the thread communicator's counts too
            self.local.all_gather(send, block, [offsets[r + 1] - offsets[r] for r in range(first, last)])
        if self.leader:
            per_process = [offsets[(q + 1) * per] - offsets[q * per] for q in range(procs)]
            self.inter.all_gather(block.copy(), out, None if counts is None else per_process)
        self.local.broadcast(out, root=0)

    def broadcast(self, buf, root: int = 0) -> None:
        root_process, root_local = divmod(root, self.local_world)
        if self.process_rank == root_process:
            self.local.broadcast(buf, root=root_local)
        if self.leader:
            self.inter.broadcast(buf, root=root_process)
        self.local.broadcast(buf, root=0)

    def barrier(self) -> None:
        self.local.barrier()
        if self.leader:
            self.inter.barrier()
        self.local.barrier()

    def split(self, color: int, key: int | None = None):
        raise XtrainError(NOT_BUILT)

    def send(self, buf, peer: int) -> None:
        raise XtrainError(NOT_BUILT)

    def recv(self, buf, peer: int) -> None:
        raise XtrainError(NOT_BUILT)

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        raise XtrainError(NOT_BUILT)

    def abort(self, reason: str) -> None:
        self.local.abort(reason)
        self.inter.abort(reason)
