"""Gradient synchronisation: how a rank's flat gradient buffer becomes the sum over all ranks.

Backward calls `on_grads_ready(start, end)` each time grads[start:end] is final; `finish()` returns
once the whole buffer is reduced. Strategies differ only in when and in what pieces they reduce.
"""

from .errors import XtrainError


class FlatGradSync:
    """One all-reduce of the whole flat buffer after backward: the fewest calls, no overlap."""

    def __init__(self, comm, grads):
        self.comm = comm
        self.grads = grads

    def on_grads_ready(self, start: int, end: int) -> None:
        pass

    def finish(self) -> None:
        self.comm.all_reduce(self.grads)


STRATEGIES = {"flat": FlatGradSync}


def make_grad_sync(name: str, comm, model):
    if name not in STRATEGIES:
        raise XtrainError(f"unknown --grad-sync '{name}' (choose from {', '.join(STRATEGIES)})")
    return STRATEGIES[name](comm, model.grads)
