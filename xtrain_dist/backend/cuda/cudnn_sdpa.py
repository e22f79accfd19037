"""--attention cudnn: cuDNN's fused attention (SDPA forward and backward, FlashAttention-2's scheme in NVIDIA's
kernels for each GPU) through the cuDNN frontend's Python module `cudnn` (the nvidia-cudnn-frontend package;
libcudnn itself from nvidia-cudnn-cu13). Why this version and what cuDNN promises: docs/cuda_backend.md.

It computes numpy_ops' flash attention: forward keeps (out, lse), lse the natural log of each row's sum of
exp(scaled scores), cuDNN's softmax statistics exactly; backward recomputes the probabilities from q, k, v,
out and lse. The rounding inside is cuDNN's own, so the CUDA tests hold it to the numpy emulation by bounds,
not bits (bin/bench_attention writes the measured error down).

Layout: no copy. q, k and v are read where c_attn wrote them, in (B, T, 3C) rows: q's head h at columns
[h hs, (h + 1) hs), k's C columns further, v's 2C; cuDNN takes each as a (B, NH, T, hs) tensor with strides
(3 T C, hs, 3C, 1) and its own base pointer. out and dout (B, T, C) are (B, NH, T, hs) with strides
(T C, hs, C, 1); lse (B, NH, T) is cuDNN's (B, NH, T, 1) statistics; dqkv is written in qkv's layout.

One graph per shape and direction, built on its first call (the first step, before a CUDA-graph capture,
which then records only their execution) and kept for the rank's run; each execution takes its workspace
from the rank's CuPy memory pool and runs on the rank's stream (the handle is bound to it).
"""

from __future__ import annotations

import numpy as np

from ...errors import XtrainError
from .device import cupy

# what --attention cudnn offers: GPT-2's 64, and 128 (cuDNN's bf16 SDPA takes up to 128 on every GPU it runs on)
HEAD_SIZES = (64, 128)
MIN_BACKEND = 90000        # libcudnn 9: the deterministic backward (use_deterministic_algorithm) on Hopper
PACKAGE = ("--attention cudnn needs the nvidia-cudnn-frontend package (module cudnn): "
           "pip install 'xtrain-dist[cuda]'")
# the graph's tensors, by the UIDs execution binds pointers to
Q, K, V, O, STATS, DO, DQ, DK, DV = range(1, 10)


def load():
    """The `cudnn` module with libcudnn loaded, or XtrainError in one line naming what to install."""
    try:
        import cudnn
    except ImportError:
        raise XtrainError(PACKAGE) from None
    try:
        version = cudnn.backend_version()
    except (RuntimeError, OSError) as err:  # the frontend loads libcudnn on first use, and says so in a RuntimeError
        raise XtrainError("--attention cudnn needs libcudnn 9 (the nvidia-cudnn-cu13 package): pip install "
                          f"'xtrain-dist[cuda]' ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                          ) from None
    if version < MIN_BACKEND:
        raise XtrainError(f"--attention cudnn needs libcudnn 9 or later; this one is {version}: pip install "
                          "'xtrain-dist[cuda]'")
    return cudnn


def loads() -> bool:
    """Whether --attention cudnn would load here (the default's rule: backend/cuda/defaults.py)."""
    try:
        load()
    except XtrainError:
        return False
    return True


def check_cudnn_attention(dtype: str, head_size: int, preset: str = "") -> None:
    """What cuDNN's fused attention takes, as --attention cudnn offers it: bf16 (its SDPA takes fp16, bf16 and
    fp8 inputs, never float32), heads of 64 or 128 channels."""
    if dtype != "bf16":
        raise XtrainError("--attention cudnn needs --dtype bf16 (cuDNN's fused attention takes 16-bit inputs, not "
                          "float32; float32 runs use --attention standard)")
    if head_size not in HEAD_SIZES:
        model = f"model '{preset}' has" if preset else "this model has"
        raise XtrainError(f"--attention cudnn needs heads of {' or '.join(map(str, HEAD_SIZES))} channels; "
                          f"{model} {head_size}")


def _strides(B: int, T: int, NH: int, hs: int, row: int) -> list[int]:
    """(B, NH, T, hs) strides of heads inside (B, T, row) token rows."""
    return [T * row, hs, row, 1]


class SdpaGraphs:
    """One rank's cuDNN handle (bound to its stream) and its attention graphs, by shape."""

    def __init__(self, stream, deterministic: bool = True):
        self.cudnn = load()
        self.stream = stream
        # the backward's dQ sums over key blocks: cuDNN's default adds them with atomics (an order that varies
        # from run to run); deterministic asks for its fixed-order algorithm, so reruns and ranks agree bitwise
        self.deterministic = deterministic
        self.handle = self.cudnn.create_handle()
        self.cudnn.set_stream(handle=self.handle, stream=stream.ptr)
        self._graphs: dict = {}

    # ------------------------------------------------------------------ building
    def _graph(self):
        c = self.cudnn
        return c.pygraph(io_data_type=c.data_type.BFLOAT16, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT, handle=self.handle)

    def _inputs(self, g, B: int, T: int, NH: int, hs: int, names):
        bf16 = self.cudnn.data_type.BFLOAT16
        qkv = _strides(B, T, NH, hs, 3 * NH * hs)
        return [g.tensor(name=name, dim=[B, NH, T, hs], stride=qkv, data_type=bf16, uid=uid) for name, uid in names]

    def _build(self, g, key):
        try:
            g.build([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        except Exception as err:  # cudnnGraphNotSupportedError, or a RuntimeError of the library's
            B, T, NH, hs = key[1:]
            raise XtrainError(f"--attention cudnn: cuDNN has no {key[0]} attention for B={B} T={T} heads={NH} x "
                              f"{hs} on this GPU ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                              ) from None
        return g, g.get_workspace_size()

    def _forward_graph(self, key):
        B, T, NH, hs = key[1:]
        g = self._graph()
        q, k, v = self._inputs(g, B, T, NH, hs, (("q", Q), ("k", K), ("v", V)))
        out, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=_scale(hs),
                            use_causal_mask=True)
        out.set_output(True).set_dim([B, NH, T, hs]).set_stride(_strides(B, T, NH, hs, NH * hs)).set_uid(O)
        stats.set_output(True).set_data_type(self.cudnn.data_type.FLOAT).set_dim([B, NH, T, 1]) \
            .set_stride([NH * T, T, 1, 1]).set_uid(STATS)
        return self._build(g, key)

    def _backward_graph(self, key):
        B, T, NH, hs = key[1:]
        c = self.cudnn
        g = self._graph()
        q, k, v = self._inputs(g, B, T, NH, hs, (("q", Q), ("k", K), ("v", V)))
        rows = _strides(B, T, NH, hs, NH * hs)
        out = g.tensor(name="o", dim=[B, NH, T, hs], stride=rows, data_type=c.data_type.BFLOAT16, uid=O)
        dout = g.tensor(name="dO", dim=[B, NH, T, hs], stride=rows, data_type=c.data_type.BFLOAT16, uid=DO)
        stats = g.tensor(name="stats", dim=[B, NH, T, 1], stride=[NH * T, T, 1, 1], data_type=c.data_type.FLOAT,
                         uid=STATS)
        grads = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=out, dO=dout, stats=stats,
                                attn_scale=_scale(hs), use_causal_mask=True,
                                use_deterministic_algorithm=self.deterministic)
        for grad, uid in zip(grads, (DQ, DK, DV), strict=True):
            grad.set_output(True).set_dim([B, NH, T, hs]).set_stride(_strides(B, T, NH, hs, 3 * NH * hs)).set_uid(uid)
        return self._build(g, key)

    def _get(self, direction: str, B: int, T: int, NH: int, hs: int):
        key = (direction, B, T, NH, hs)
        if key not in self._graphs:
            self._graphs[key] = (self._forward_graph if direction == "forward" else self._backward_graph)(key)
        return self._graphs[key]

    # ------------------------------------------------------------------ running
    def _execute(self, graph_and_size, pointers: dict) -> None:
        graph, size = graph_and_size
        if cupy.cuda.get_current_stream().ptr != self.stream.ptr:
            raise RuntimeError("cuda_ops cudnn attention: called from a thread whose current stream is not the rank's "
                               "(cuDNN's handle runs on the rank's stream)")
        workspace = cupy.empty(max(size, 1), dtype=np.uint8)  # from the rank's pool (the graph's, in a capture)
        graph.execute(pointers, workspace.data.ptr, handle=self.handle)

    def forward(self, out, lse, qkv, B: int, T: int, NH: int, hs: int) -> None:
        base, item = qkv.data.ptr, qkv.itemsize
        self._execute(self._get("forward", B, T, NH, hs),
                      {Q: base, K: base + NH * hs * item, V: base + 2 * NH * hs * item, O: out.data.ptr,
                       STATS: lse.data.ptr})

    def backward(self, dqkv, dout, qkv, out, lse, B: int, T: int, NH: int, hs: int) -> None:
        base, dbase, C = qkv.data.ptr, dqkv.data.ptr, NH * hs * qkv.itemsize
        self._execute(self._get("backward", B, T, NH, hs),
                      {Q: base, K: base + C, V: base + 2 * C, O: out.data.ptr, DO: dout.data.ptr,
                       STATS: lse.data.ptr, DQ: dbase, DK: dbase + C, DV: dbase + 2 * C})


def _scale(hs: int) -> float:
    """1/sqrt(hs) rounded to float32, as numpy_ops applies it to the scores."""
    return float(np.float32(1.0 / np.sqrt(hs)))
