"""Communicators: the collectives data parallelism needs, behind one protocol.

Implementations: `local` (ranks are threads of this process; numpy or CuPy buffers), and, for
several processes, `mpi` (host buffers, mpi4py), `tcp` (host buffers, sockets to rank 0), `nccl` (GPU
buffers, nccl4py) and `hybrid` (rank threads inside processes); `world.open_world` picks and joins one.
Every collective is in place or into a caller's buffer, a sum where it reduces, and gives every rank
the same bits. All but NCCL return when the result is in place; NCCL's are enqueued on the rank's
stream (stream order makes them visible) and `synchronize()` waits for them on the host.

A communicator serves one collective at a time: every rank must issue the same collectives in the
same order, and a rank that drives it from two threads (a communication thread beside the rank's
own, ddp.BucketedGradSync) must not let their calls overlap.

`counts` (reduce_scatter, all_gather) gives each rank's share of the whole buffer, in rank order:
rank r owns elements [sum(counts[:r]), sum(counts[:r+1])); a count may be 0. None means equal shares
(the buffer size divisible by the world size). That is MPI's Reduce_scatter/Allgatherv; on NCCL,
equal counts are ncclReduceScatter/ncclAllGather and unequal ones a group of ncclReduce/ncclBroadcast,
one per rank. ZeRO-1 needs them: its shards and its gradient buckets do not divide evenly.

Groups are made by `split(color, key)`, MPI's Comm_split and NCCL's ncclCommSplit one for one (rather
than `new_group(ranks)`, which every rank would have to call with every group's list): a rank says only
which group it joins, the call is collective over the communicator split, and the new communicator has
the whole protocol, collectives and point-to-point. Groups split from one world fail together: an abort
of any of them (a rank that died, a timeout) aborts them all. `send`/`recv`/`sendrecv` move one buffer
between two ranks of a communicator; a message of another size than the receiver's buffer is an error
that names both, and a peer that never sends is caught by the timeout.
"""

import threading
from typing import Protocol


class CommAborted(RuntimeError):
    """Raised in a rank whose collective was cut short because another rank failed or timed out."""


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, buf) -> None:
        """buf = sum of every rank's buf, in place."""

    def broadcast(self, buf, root: int = 0) -> None:
        """buf = root's buf, in place."""

    def all_gather(self, send, recv, counts=None) -> None:
        """recv[offset(r):offset(r)+counts[r]] = rank r's send, for every r (counts[r] = that send's size).

        send may be recv's own slice at offset(rank) (in place)."""

    def reduce_scatter(self, send, recv, counts=None) -> None:
        """recv = sum over ranks of send[offset(rank):offset(rank)+counts[rank]] (counts[rank] = recv.size).

        recv may be send's own slice at offset(rank) (in place); the rest of send is left as it was."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def abort(self, reason: str) -> None:
        """Make every rank's pending and future collectives raise CommAborted (called on failure)."""

    def split(self, color: int, key: int | None = None) -> "Communicator":
        """Collective over this communicator: a new communicator of the ranks that passed the same color,
        ranked by (key, rank in this one); key None keeps this one's order. MPI_Comm_split, ncclCommSplit."""

    def send(self, buf, peer: int) -> None:
        """Send buf to rank peer (blocking; it may wait until peer receives: pair it, or use sendrecv)."""

    def recv(self, buf, peer: int) -> None:
        """buf = the next message from rank peer, of exactly buf's size and type (blocking)."""

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        """send to dest and recv from source at once: a ring of these never deadlocks."""


def shard_offsets(total: int, world_size: int, counts=None) -> list[int]:
    """The world_size + 1 boundaries of the shares in a reduce_scatter/all_gather buffer of `total`
    elements: equal shares when counts is None. Bad counts are a bug of the caller: ValueError."""
    if counts is None:
        if total % world_size:
            raise ValueError(f"{total} elements do not split into {world_size} equal shares: pass counts")
        counts = [total // world_size] * world_size
    if len(counts) != world_size or any(c < 0 for c in counts) or sum(counts) != total:
        raise ValueError(f"counts {list(counts)} do not split {total} elements over {world_size} ranks")
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + int(c))
    return offsets


def rank_share_offsets(total: int, world_size: int, rank: int, counts, given: int, role: str) -> list[int]:
    """shard_offsets, after checking that this rank's own buffer (`role`: reduce_scatter's "recv",
    all_gather's "send") holds `given` elements, exactly its share. A mismatch is a bug: ValueError."""
    offsets = shard_offsets(total, world_size, counts)
    share = offsets[rank + 1] - offsets[rank]
    if given != share:
        raise ValueError(f"rank {rank}: {role} has {given} elements, its share is {share}")
    return offsets


def check_split(color, key) -> None:
    """A split's color is a non-negative int (every rank joins a group), its key an int or None; bad
    arguments are a bug of the caller: ValueError."""
    if isinstance(color, bool) or not isinstance(color, int) or color < 0:
        raise ValueError(f"a group's color must be a non-negative integer, got {color!r}")
    if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
        raise ValueError(f"a group's key must be an integer, got {key!r}")


def split_members(colors_and_keys) -> dict[int, list[int]]:
    """{color: the ranks that passed it, ordered by (key, rank)}, from every rank's (color, key)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for rank, (color, key) in enumerate(colors_and_keys):
        groups.setdefault(color, []).append((key, rank))
    return {color: [rank for _, rank in sorted(members)] for color, members in sorted(groups.items())}


def check_peer(comm, peer) -> None:
    """A point-to-point peer is another rank of the communicator."""
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < comm.world_size or peer == comm.rank:
        raise ValueError(f"rank {comm.rank}: peer {peer!r} is not another rank of this communicator "
                          f"(0 .. {comm.world_size - 1})")


def send_while_receiving(send, recv, name: str) -> None:
    """Run send() on a second thread while this one runs recv(), then raise what send raised: a send that
    may wait until its receiver receives (TCP's sendall on a full socket buffer, MPI's rendezvous) would
    otherwise deadlock two ranks that send each other a buffer at once."""
    failed = []

    def sending():
        try:
            send()
        except BaseException as e:
            failed.append(e)

    sender = threading.Thread(target=sending, name=name, daemon=True)
    sender.start()
    try:
        recv()
    finally:
        sender.join()
    if failed:
        raise failed[0]
