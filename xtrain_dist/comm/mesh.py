"""The device mesh: world = pp x dp x tp ranks, and a communicator along each axis.

    ranks = arange(world).reshape(pp, dp, tp)        # tp fastest, then dp, then pp

so rank = (pp_index * dp + dp_index) * tp + tp_index. Tensor-parallel partners are neighbours (on a
node of GPUs they share the fastest links, and TP's all-reduces are the most frequent), data-parallel
partners are tp apart, and pipeline stages are dp x tp apart. For world 8 = 2 x 2 x 2:

    stage 0:  dp 0: [0 1]   dp 1: [2 3]        tp groups: [0 1] [2 3] [4 5] [6 7]
    stage 1:  dp 0: [4 5]   dp 1: [6 7]        dp groups: [0 2] [1 3] [4 6] [5 7]
                                               pp groups: [0 4] [1 5] [2 6] [3 7]

Each axis's communicator is one split of the world (colour: the other two coordinates, key: the
coordinate along the axis), so rank i of the tp group is tp_index i, and so on. A mesh is built by
every rank of the world (split is collective) and passed explicitly: ranks may be threads of one
process, so nothing of it lives in a module global.
"""


class DeviceMesh:
    def __init__(self, world, dp: int, tp: int = 1, pp: int = 1):
        """world: this rank's communicator of all dp x tp x pp ranks."""
        for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"the mesh's {name} size must be a positive integer, got {size!r}")
        if dp * tp * pp != world.world_size:
            raise ValueError(f"a mesh of dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp} ranks does not fit a world "
                             f"of {world.world_size}")
        self.world, self.dp_size, self.tp_size, self.pp_size = world, dp, tp, pp
        self.rank = world.rank
        self.pp_index, self.dp_index, self.tp_index = mesh_coordinates(world.rank, dp, tp, pp)
        # the three splits in one fixed order on every rank: split is a collective of the world
        self.tp = world.split(self.pp_index * dp + self.dp_index, self.tp_index)
        self.dp = world.split(self.pp_index * tp + self.tp_index, self.dp_index)
        self.pp = world.split(self.dp_index * tp + self.tp_index, self.pp_index)

    # ---------------------------------------------------------------- the pipeline
    @property
    def is_first(self) -> bool:
        return self.pp_index == 0

    @property
    def is_last(self) -> bool:
        return self.pp_index == self.pp_size - 1

    @property
    def prev(self) -> int | None:
        """The previous stage's rank in the pp communicator (None on the first stage)."""
        return None if self.is_first else self.pp_index - 1

    @property
    def next(self) -> int | None:
        """The next stage's rank in the pp communicator (None on the last stage)."""
        return None if self.is_last else self.pp_index + 1

    def group_ranks(self, axis: str) -> list[int]:
        """The world ranks of this rank's group along axis ('dp', 'tp' or 'pp'), in the group's rank order."""
        coords = {"pp": self.pp_index, "dp": self.dp_index, "tp": self.tp_index}
        size = {"pp": self.pp_size, "dp": self.dp_size, "tp": self.tp_size}
        if axis not in coords:
            raise ValueError(f"a mesh axis is 'dp', 'tp' or 'pp', not {axis!r}")
        ranks = []
        for i in range(size[axis]):
            at = dict(coords, **{axis: i})
            ranks.append(mesh_rank(at["pp"], at["dp"], at["tp"], self.dp_size, self.tp_size))
        return ranks


def mesh_coordinates(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(pp_index, dp_index, tp_index) of a world rank in arange(world).reshape(pp, dp, tp)."""
    if not 0 <= rank < dp * tp * pp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * tp * pp} ranks")
    return rank // (dp * tp), rank // tp % dp, rank % tp


def mesh_rank(pp_index: int, dp_index: int, tp_index: int, dp: int, tp: int) -> int:
    """The world rank at those coordinates: (pp_index * dp + dp_index) * tp + tp_index."""
    return (pp_index * dp + dp_index) * tp + tp_index
