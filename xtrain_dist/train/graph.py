"""--cuda-graph: the training step captured once as a CUDA graph and replayed, one launch per step.

A step queues some hundreds of kernels, products and collectives; replayed from a graph they cost one
launch on the host. What the step reads from the host each time (the micro-batches, AdamW's learning
rate and bias corrections, the stop request) lives in arrays kept for the run, which the loop rewrites
with asynchronous copies before each launch (train/loop.py, optimizer.prepare), so a replay needs no
host synchronisation; the loss comes back through a copy queued after it.

The first step runs as usual, with the rank thread allocating from a memory pool of the graph's own: it
fills the pool with the blocks a step takes. The second step is captured on the rank's stream with the
same pool, so its allocations come from those blocks (a cudaMalloc is not allowed in a capture), and then
launched; every later step is a launch. The pool is used by nothing else, so the blocks the graph writes
on each launch are never handed to another array. The bucketed gradient sync's communication thread
joins the capture through the events it already waits for and records (a stream that waits for an event
recorded in a capture is captured too, and the compute stream waits for its last one), so its NCCL calls
go into the same graph.

With --tp and --pp the captured step holds the rank's tensor-parallel all-reduces, its pipeline transfers
(NCCL's send and recv, which NCCL captures once the first, uncaptured step has made their connections) and the
sum of the two wte copies, each stage its own graph of its own part of the schedule: every rank captures the
same step, so the ranks of each group launch their captured collectives together, as NCCL asks. The
overlapped sync's buckets settle before each of them inside the capture as outside it (parallel/ddp.py).

Which communicators can be captured is decided before the first step (`unsupported`): NCCL can, and so
can any communicator of a one-rank world (there is nothing to exchange). The in-process communicator of
virtual ranks cannot: its exchange synchronizes the rank threads and their streams on the host. Nor can
MPI or TCP, which move the data through host memory. Nor are ZeRO-2 and -3 captured: the unit buffers their
communication thread fills and empties come and go within the step (parallel/zero.py). There, and wherever a
capture fails, the run says so in one line and runs without graphs.

Steps that profile run outside the graph (they time each op); evaluation, samples and checkpoints come
after a step and run as usual, outside it.
"""

import contextlib

cupy = None  # CuPy, once a StepGraph is made
MODES = ("auto", "off")


def unsupported(cfg, comm) -> str | None:
    """Why this rank's step cannot be captured, or None where it can."""
    if cfg.grad_compress == "powersgd":
        return "PowerSGD decides on the host whether a step compresses (--powersgd-start-step)"
    if cfg.zero >= 2:
        return (f"ZeRO-{cfg.zero} is not captured: its communication thread's gathers and reduce-scatters, and "
                "the unit buffers that come and go with them, run outside graphs so far")
    if comm.world_size == 1:
        return None
    if cfg.all_reduce == "ring":
        return "the ring all-reduce (--all-reduce ring) is not captured: its steps are issued from the host"
    if type(comm).__name__ == "NcclCommunicator":
        return None
    if type(comm).__name__ == "LocalCommunicator":
        return ("the in-process communicator of virtual ranks synchronizes the rank threads on the host, which a "
                "captured step cannot do")
    return f"the {type(comm).__name__} moves gradients through host memory, which a captured step cannot do"


class StepGraph:
    """Runs `step` (the device part of a training step) as the first step, the capture, or a replay."""

    def __init__(self, step, stream, on_failure):
        global cupy
        from ..backend.cuda.device import cupy  # here: the command line imports this module without CuPy

        self.step = step
        self.stream = stream
        self.pool = cupy.cuda.MemoryPool()
        self.graph = None
        self.warm = False
        self.on_failure = on_failure  # called with the reason, once, when a capture fails
        self.failed = False

    def __call__(self) -> bool:
        """Run one step; True where it ran from the graph."""
        if self.failed:
            self.step()
            return False
        with cupy.cuda.using_allocator(self.pool.malloc):
            if not self.warm:
                self.step()
                self.warm = True
                return False
            if self.graph is None:
                self.stream.begin_capture()
                try:
                    self.step()
                except (cupy.cuda.runtime.CUDARuntimeError, NotImplementedError) as e:
                    # the driver's refusal, or CuPy's of what it cannot do in a capture (a cuBLAS call through
                    # its own wrappers did that on an H200)
                    _end_quietly(self.stream)
                    self.failed = True
                    refused = f"{e}" if isinstance(e, cupy.cuda.runtime.CUDARuntimeError) else f"CuPy: {e}"
                    self.on_failure(f"the capture failed: {refused}")
                    # nothing of the step ran on the device: run it now
                    self.step()
                    return False
                except BaseException:
                    _end_quietly(self.stream)
                    raise
                self.graph = self.stream.end_capture()
        self.graph.launch(self.stream)
        return True


def _end_quietly(stream) -> None:
    with contextlib.suppress(Exception):  # the capture was invalidated already: nothing to end
        stream.end_capture()
