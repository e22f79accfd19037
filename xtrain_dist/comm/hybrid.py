"""Thread ranks inside process ranks: several rank threads per process, several processes per job.

Global rank g = process_rank * local_world + local (a group split from the world numbers its own ranks:
`members` says which thread of which process each is). A collective is three simple ones: the threads of a
process combine among themselves (the thread communicator), thread 0 of each process (the leader) runs
the collective across processes (MPI or TCP, process ranks), and the leader's result is broadcast to
its threads. Only leaders call the process communicator, one call at a time, so the world's collectives
need no more than MPI_THREAD_SERIALIZED and the process communicators stay one-rank-per-process. Every
rank gets identical bits: the cross-process result is computed once per element and copied.

Groups (`split`, as the device mesh makes them) take the cheapest communicator that holds them:

    inside one process                 -> the thread communicator of its threads (local.split)
    one rank thread in each process    -> a process communicator of those processes (inter.split): rank
                                          i of the group is the process holding its rank i
    several threads in several         -> another HybridCommunicator: the group's threads of each process,
    processes                             and a process communicator of the group's processes

With the mesh's order (tp fastest) and --tp dividing the threads per process, each tensor-parallel group
is the threads of one process; the data-parallel and pipeline groups of one thread per process are plain
MPI or TCP communicators. Each process communicator of a group is the leader's split of the world's, one
split per group that spans processes, so two threads of a process never share one: one thread of process
0 all-reducing over the group [0, 2] while another all-reduces over [1, 3] is two MPI communicators used at
once, which MPI allows at MPI_THREAD_MULTIPLE (mpi4py initialises MPI at that level by default, and MPICH
grants it; a library that grants less is refused in one line when such groups are made).

Point-to-point between two threads of one process goes through the thread communicator; between threads
of different processes, through a communicator of that pair of threads alone (a two-process split made
with the group), so concurrent messages of other pairs can never be received in its place. That is one
split per pair of a group's ranks in different processes, at most n(n-1)/2 for n ranks: groups of the
third kind are few and small (tp or pp across nodes). A group of one thread per process needs no pairs
(its process communicator is the pairs'). The world itself has none (W x W of them for every job, whether
or not it sends): messages go over a group split from it.
"""


import numpy as np

from ..errors import XtrainError
from . import check_peer, check_split, rank_share_offsets, send_while_receiving, split_members

WORLD_POINT_TO_POINT = ("point-to-point between rank threads of different processes runs on a group split from "
                        "the world (comm.split; the device mesh's groups), not on the world itself")
NO_THREAD_MULTIPLE = ("groups across rank threads of several MPI processes have several threads of a process call "
                      "MPI at once, and this MPI library was initialised without MPI_THREAD_MULTIPLE: run one "
                      "rank thread per process (mpirun -n N with --world-size N)")


class HybridCommunicator:
    def __init__(self, local, inter, process_rank: int, local_world: int | None = None, members=None, pairs=None):
        """The world (members None): local_world threads in each of inter's processes. A group: `members`, the
        (process rank in inter, thread rank in local) of each of its ranks in order, and `pairs`, {peer rank:
        (communicator of this rank and peer alone, peer's rank in it)} for peers in other processes."""
        self.local, self.inter = local, inter
        if members is None:
            members = [(p, t) for p in range(inter.world_size) for t in range(local_world)]
        self.members, self.pairs = members, pairs
        self.process_rank = process_rank
        self.rank = members.index((process_rank, local.rank))
        self.world_size = len(members)
        self.leader = local.rank == 0
        # each process's ranks, in order (the thread communicator's of that process)
        self._by_process = [[r for r, (p, _) in enumerate(members) if p == q] for q in range(inter.world_size)]
        self._contiguous = [r for ranks in self._by_process for r in ranks] == list(range(self.world_size))
        # the world's ranks of this one, for the job ranks of the groups split from it (failure lines)
        self.job_ranks: list[int] | None = None

    def job(self, rank: int) -> int:
        return rank if self.job_ranks is None else self.job_ranks[rank]

    @property
    def concurrent_groups(self) -> bool:
        """Whether two threads of a process may call the process communicator's library at once."""
        return getattr(self.inter, "concurrent_groups", True)

    # ---------------------------------------------------------------- collectives
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
        out = recv.reshape(-1)
        offsets = rank_share_offsets(out.size, self.world_size, self.rank, counts, send.size, "send")
        share = [offsets[r + 1] - offsets[r] for r in range(self.world_size)]
        mine = self._by_process[self.process_rank]
        if self._contiguous:  # this process's ranks are contiguous in the group's order: gather in place
            block = out[offsets[mine[0]]:offsets[mine[-1] + 1]]
        else:  # their shares are apart: packed, this process's in its threads' order
            block = np.empty_like(out, shape=(sum(share[r] for r in mine),))
        if counts is None and self._contiguous:
            self.local.all_gather(send, block)
        else:  # unequal shares need the thread communicator's counts too
            self.local.all_gather(send, block, [share[r] for r in mine])
        if self.leader:
            per_process = [sum(share[r] for r in ranks) for ranks in self._by_process]
            if self._contiguous:  # (equal shares make equal blocks only where every process holds as many ranks)
                equal = counts is None and len(set(per_process)) == 1
                self.inter.all_gather(block.copy(), out, None if equal else per_process)
            else:  # every process's packed block, in process order, then each share to its place
                packed = np.empty_like(out)
                self.inter.all_gather(block, packed, per_process)
                at = 0
                for ranks in self._by_process:
                    for r in ranks:
                        out[offsets[r]:offsets[r + 1]] = packed[at:at + share[r]]
                        at += share[r]
        self.local.broadcast(out, root=0)

    def broadcast(self, buf, root: int = 0) -> None:
        root_process, root_local = self.members[root]
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

    # ---------------------------------------------------------------- groups
    def split(self, color: int, key: int | None = None):
        """Collective over every rank of this communicator: see the module's table for what it returns."""
        check_split(color, key)
        everyone = np.empty(2 * self.world_size, np.int64)
        self.all_gather(np.array([color, self.rank if key is None else key], np.int64), everyone)
        groups = split_members(list(zip(everyone[0::2].tolist(), everyone[1::2].tolist(), strict=True)))
        # each group's processes, in the order of its first rank in each
        process_of = {c: list(dict.fromkeys(self.members[r][0] for r in ranks)) for c, ranks in groups.items()}
        ranks = groups[color]
        # this process's ranks of every group, ranked by their place in it (collective over the process's threads)
        part = self.local.split(color, ranks.index(self.rank))
        spanning = [c for c in groups if len(process_of[c]) > 1]
        if spanning and not self.concurrent_groups:
            raise XtrainError(NO_THREAD_MULTIPLE)
        # the leader makes this process's communicators of the groups that span processes, and shares them with
        # its threads through the thread group they have in common (the other threads wait at the barrier)
        shared = self.local.group
        if self.leader:
            shared.hybrid_split = self._split_processes(groups, process_of, spanning)
        self.local.barrier()
        across, pair_comms = shared.hybrid_split
        self.local.barrier()  # every thread has read them before a later split overwrites them
        job_ranks = [self.job(r) for r in ranks]
        part.group.job_ranks = [self.job(r) for r in ranks if self.members[r][0] == self.process_rank]
        processes = process_of[color]
        if len(processes) == 1:  # inside this process
            return part
        group = across[color]
        group.job_ranks = job_ranks
        if len(processes) == len(ranks):  # one thread per process: the process communicator is the group
            return group
        members = [(processes.index(self.members[r][0]), 0) for r in ranks]
        for q in range(len(processes)):  # thread rank = place among the process's ranks of the group
            at_q = [i for i, (p, _) in enumerate(members) if p == q]
            for t, i in enumerate(at_q):
                members[i] = (q, t)
        me = ranks.index(self.rank)
        pairs = {peer: (comm, 1 - side) for (a, b), (comm, side) in pair_comms.get(color, {}).items()
                 for peer in (a, b) if me in (a, b) and peer != me}
        hybrid = HybridCommunicator(part, group, processes.index(self.process_rank), members=members, pairs=pairs)
        hybrid.job_ranks = job_ranks
        return hybrid

    def _split_processes(self, groups, process_of, spanning):
        """The leader's part of split: one split of the process communicator per group that spans processes
        (this process passes color 0 where it holds ranks of the group, 1 where not), and one per pair of the
        group's ranks in different processes where the group has several threads of a process. Every leader
        runs the same splits in the same order, from the same table."""
        across, pairs = {}, {}
        for c in spanning:
            processes = process_of[c]
            inside = self.process_rank in processes
            sub = self.inter.split(0 if inside else 1, processes.index(self.process_rank) if inside else 0)
            if inside:
                across[c] = sub
            else:
                _discard(sub)
        for c in spanning:
            ranks, processes = groups[c], process_of[c]
            if c not in across or len(processes) == len(ranks):
                continue
            process = [processes.index(self.members[r][0]) for r in ranks]  # each rank's process in the group's
            here = processes.index(self.process_rank)
            for a in range(len(ranks)):
                for b in range(a + 1, len(ranks)):
                    if process[a] == process[b]:
                        continue
                    ends = (process[a], process[b])
                    sub = across[c].split(0 if here in ends else 1, ends.index(here) if here in ends else 0)
                    if here in ends:  # (the pair's communicator, this process's side: rank 0 holds a, rank 1 b)
                        pairs.setdefault(c, {})[(a, b)] = (sub, ends.index(here))
                    else:
                        _discard(sub)
        return across, pairs

    # ---------------------------------------------------------------- point-to-point
    def _peer(self, peer: int):
        """(the communicator that reaches peer, peer's rank in it)."""
        check_peer(self, peer)
        process, thread = self.members[peer]
        if process == self.process_rank:
            return self.local, thread
        if self.pairs is None or peer not in self.pairs:
            raise XtrainError(WORLD_POINT_TO_POINT)
        return self.pairs[peer]

    def send(self, buf, peer: int) -> None:
        comm, at = self._peer(peer)
        comm.send(buf, at)

    def recv(self, buf, peer: int) -> None:
        comm, at = self._peer(peer)
        comm.recv(buf, at)

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        (to, at_dest), (frm, at_source) = self._peer(dest), self._peer(source)
        if to is frm:  # the thread communicator, or the one pair's: its own sendrecv
            return to.sendrecv(send, at_dest, recv, at_source)
        if to is self.local:  # a thread's send is a copy posted at once: it never waits for the receiver
            to.send(send, at_dest)
            return frm.recv(recv, at_source)
        # an MPI or TCP send may wait until its receiver receives, which may wait on this rank's receive
        send_while_receiving(lambda: to.send(send, at_dest), lambda: frm.recv(recv, at_source),
                             f"hybrid-send-{self.rank}")

    def abort(self, reason: str) -> None:
        self.local.abort(reason)
        self.inter.abort(reason)


def _discard(comm) -> None:
    """A split's other group, that this process takes no part in: its sockets closed (TCP); an MPI one is
    left to MPI_Finalize (freeing it is one more collective among the others)."""
    peers = getattr(comm, "peers", None)
    if peers is not None:
        from .rendezvous import close_all
        close_all(peers)
