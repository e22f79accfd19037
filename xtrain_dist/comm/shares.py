"""How a reduce_scatter/all_gather buffer splits over the ranks: `counts` gives each rank's share in
rank order (rank r owns [sum(counts[:r]), sum(counts[:r+1])); a count may be 0); None means equal
shares, which the buffer size must allow. The communicators of several processes use it; it has the
contract of the thread communicator's `counts` (ZeRO-1's shards and buckets do not divide evenly)."""


def share_offsets(total: int, world_size: int, counts=None) -> list[int]:
    """The world_size + 1 boundaries of the shares of `total` elements. Bad counts are the caller's
    bug: ValueError."""
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
