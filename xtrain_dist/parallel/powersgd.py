"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): each gradient matrix sent as a rank-R product P Q^T.

The algorithm and its defaults are those of PyTorch's DDP communication hook
(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook). For a gradient matrix M (m x n) of a rank:

    M' = M + e                         error feedback: what earlier steps did not send is added back
    P  = M' Q                          Q (n x R) kept from the previous step (warm start), orthonormalised
    P  = all_reduce(P)                 the sum over ranks: every rank now holds the same P
    P  = gram_schmidt(P)               the same bits on every rank
    Q  = M'^T P;  Q = all_reduce(Q)    the sum over ranks
    M_hat = P Q^T                      ~ the sum over ranks of M', what the rest of the sync delivers too
    e  = M' - M_hat / world            this rank's share of what was not sent

M_hat is built from all-reduced values only, so every rank gets the same bits. The rank's errors sum to
what the ranks' gradients hold beyond M_hat, and they are carried to the next step. Gradients are sums
over ranks here (each rank's loss is scaled by 1/(BATCH*SEQ) for the whole batch), so M_hat approximates
the sum, where PyTorch's hook, which sees means, divides by the world size.

Vectors (biases, layernorms) and matrices for which (m + n) R x min_compression_rate is not below m n are
all-reduced as they are, packed into one buffer per piece. Before --powersgd-start-step steps are done
every piece is all-reduced as it is and no error is kept (PyTorch's start_powerSGD_iter).

The same code runs on numpy and on CuPy arrays (the backend's `xp`; the products through cuBLAS there).

On a mesh (--tp, --pp) PowerSGD runs on the rank's data-parallel group only: `comm` is that group's, and the
matrices are the ones the rank holds, its tensor-parallel shard of each block matrix and its pipeline stage's
matrices, each with its own Q and error buffer. The ranks of a data-parallel group hold the same shards, so
each group reduces its own shard, as the data-parallel reduction of Megatron-LM and DeepSpeed does: the
tensor-parallel and pipeline communication stays as it is. A shard's rank-R approximation is not that shard of the whole
matrix's rank-R approximation, so a run at --tp 2 does not follow a --tp 1 PowerSGD run step by step (nor a
--pp 2 run a --pp 1 one: the stages draw their Q in their own layout order, and the two copies of wte are
compressed apart before sum_tied_embedding_grads adds them). What a tensor-parallel group holds whole
(layernorms, row-parallel biases, wpe, wte under --tp-classifier replicated) has the same gradient bits on each
of its ranks (model.py's notes); every rank of the group has the same shapes in the same layout order, so it
draws the same Q for them, and then runs the same arithmetic on the same bits: they stay equal.

What differs from PyTorch's hook: vectors and small matrices keep no error (PyTorch keeps each rank's
difference from the mean for them, which sums to zero over the ranks); Gram-Schmidt at every rank
(PyTorch switches to QR above rank 2, whose bits depend on the LAPACK build); a column that is all zero
stays zero instead of becoming NaN (PyTorch's orthogonalization_epsilon = 0 divides by its zero norm);
Q starts from one seeded generator drawn once for every matrix in layout order, not from a fresh seed at
the first compressed step.
"""

import numpy as np

from ..errors import XtrainError

MIN_COMPRESSION_RATE = 2.0  # PyTorch's default: compress only where it at least halves the bytes


def should_compress(rows: int, cols: int, rank: int, min_rate: float = MIN_COMPRESSION_RATE) -> bool:
    """PyTorch's _should_compress: P and Q together, times min_rate, are smaller than the matrix."""
    return (rows + cols) * rank * min_rate < rows * cols


def sent_elements(layout, rank: int, min_rate: float = MIN_COMPRESSION_RATE) -> int:
    """Elements each rank all-reduces in a compressed step: P (m x R) and Q (n x R) of every matrix that is
    compressed, every other parameter whole. Multiply by 4 for the bytes of float32."""
    total = 0
    for s in layout:
        r = min(rank, *s.shape) if len(s.shape) == 2 else 0
        total += sum(s.shape) * r if r and should_compress(*s.shape, r, min_rate) else s.size
    return total


def state_elements(layout, rank: int, min_rate: float = MIN_COMPRESSION_RATE) -> int:
    """Elements of a rank's PowerSGD state: every compressed matrix's error buffer (m x n) and Q (n x R)."""
    total = 0
    for s in layout:
        if len(s.shape) == 2 and should_compress(*s.shape, min(rank, *s.shape), min_rate):
            total += s.size + s.shape[1] * min(rank, *s.shape)
    return total


def gram_schmidt(a, xp=np) -> None:
    """Orthonormalise the columns of a (m x R, m >= R) in place, one after another (modified Gram-Schmidt,
    PyTorch's _orthogonalize_gram_schmidt). A column that is all zero (nothing left after the projections)
    stays zero. xp: the array module of a (numpy, or cupy on a GPU)."""
    for i in range(a.shape[1]):
        col = a[:, i:i + 1]
        norm = xp.sqrt(xp.sum(col * col))
        col /= xp.where(norm > 0, norm, a.dtype.type(1))
        if i + 1 < a.shape[1]:
            rest = a[:, i + 1:]
            rest -= xp.sum(col * rest, axis=0, keepdims=True) * col


class PowerSGD:
    """One rank's PowerSGD: which parameters it compresses, their Q and error buffers, and the reduction of a
    piece grads[lo:hi] made of whole parameters (`__call__`, a PieceReducer for parallel/ddp.py's strategies).

    `steps_done` counts the optimizer steps whose gradients it has reduced; `step_done()` is called at the
    end of each (ddp.PowerSGDGradSync.finish), and a resumed run sets it to the checkpoint's step."""

    def __init__(self, comm, model, rank: int, start_step: int, seed: int,
                 min_compression_rate: float = MIN_COMPRESSION_RATE):
        self.comm, self.grads, self.ops = comm, model.grads, model.ops
        self.rank, self.start_step = rank, start_step
        self.layout = model.layout
        xp = self.xp = model.ops.xp
        dtype = model.grads.dtype
        self.compressed = {s.name for s in self.layout
                           if len(s.shape) == 2 and should_compress(*s.shape, min(rank, *s.shape),
                                                                    min_compression_rate)}
        # Q starts as the same normal draws on every rank: one generator, every matrix in layout order (on a mesh
        # the rank's layout, whose shapes and order every rank of its tensor-parallel group shares)
        rng = np.random.default_rng(seed)
        self.q, self.error = {}, {}
        for s in self.layout:
            if s.name in self.compressed:
                q = rng.standard_normal((s.shape[1], min(rank, *s.shape))).astype(dtype)
                gram_schmidt(q)
                self.q[s.name] = model.ops.from_host(q)
                self.error[s.name] = xp.zeros(s.shape, dtype=dtype)
        self.steps_done = 0
        self.elements_sent = 0  # in the latest step: what each rank's all-reduces carried

    @property
    def active(self) -> bool:
        return self.steps_done >= self.start_step

    def step_done(self) -> None:
        self.steps_done += 1

    def __call__(self, lo: int, hi: int) -> None:
        if not self.active:
            self.comm.all_reduce(self.grads[lo:hi])
            self.elements_sent += hi - lo
            return
        xp, g = self.xp, self.grads
        specs = [s for s in self.layout if s.offset < hi and s.offset + s.size > lo]
        if any(s.offset < lo or s.offset + s.size > hi for s in specs):
            raise RuntimeError(f"grads[{lo}:{hi}] cuts a parameter: PowerSGD reduces pieces of whole parameters")
        plain = [s for s in specs if s.name not in self.compressed]
        matrices = [s for s in specs if s.name in self.compressed]
        if plain:  # one all-reduce of every vector and small matrix in the piece
            packed = xp.concatenate([g[s.offset:s.offset + s.size] for s in plain])
            self.comm.all_reduce(packed)
            self.elements_sent += packed.size
            at = 0
            for s in plain:
                g[s.offset:s.offset + s.size] = packed[at:at + s.size]
                at += s.size
        if not matrices:
            return
        grads = [g[s.offset:s.offset + s.size].reshape(s.shape) for s in matrices]
        for s, m in zip(matrices, grads, strict=True):
            m += self.error[s.name]
            gram_schmidt(self.q[s.name], xp)  # the warm start: last step's Q, made orthonormal again
        ps = self._packed([(s.shape[0], self.q[s.name].shape[1]) for s in matrices])
        for m, s, p in zip(grads, matrices, ps[1], strict=True):
            p[...] = m @ self.q[s.name]
        self.comm.all_reduce(ps[0])
        qs = self._packed([self.q[s.name].shape for s in matrices])
        for m, p, q in zip(grads, ps[1], qs[1], strict=True):
            gram_schmidt(p, xp)
            q[...] = m.T @ p
        self.comm.all_reduce(qs[0])
        self.elements_sent += ps[0].size + qs[0].size
        share = g.dtype.type(1 / self.comm.world_size)
        for s, m, p, q in zip(matrices, grads, ps[1], qs[1], strict=True):
            approx = p @ q.T
            self.error[s.name][...] = m - approx * share
            m[...] = approx
            self.q[s.name][...] = q

    def _packed(self, shapes):
        """One buffer for every matrix's factor (one all-reduce), and the factors as views of it."""
        flat = self.xp.empty(sum(r * c for r, c in shapes), dtype=self.grads.dtype)
        views, at = [], 0
        for r, c in shapes:
            views.append(flat[at:at + r * c].reshape(r, c))
            at += r * c
        return flat, views

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of every Q (the same on every rank) and of this rank's error buffers."""
        to_host = self.ops.to_host
        return {**{f"q.{name}": to_host(q) for name, q in self.q.items()},
                **{f"error.{name}": to_host(e) for name, e in self.error.items()}}

    def load_state_dict(self, tensors: dict[str, np.ndarray], where: str) -> None:
        expected = {f"q.{n}": q.shape for n, q in self.q.items()}
        expected |= {f"error.{n}": e.shape for n, e in self.error.items()}
        found = {name: tuple(t.shape) for name, t in tensors.items()}
        if found != expected:
            raise XtrainError(f"{where} holds other PowerSGD state than this run's (--powersgd-rank {self.rank} of "
                              "this model): resume with the options it was saved with")
        for name, t in tensors.items():
            kind, param = name.split(".", 1)
            (self.q if kind == "q" else self.error)[param][...] = self.ops.from_host(np.ascontiguousarray(t))
