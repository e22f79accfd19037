"""A stand-in for the cuDNN frontend's Python module `cudnn` (nvidia-cudnn-frontend), the part
xtrain_dist/backend/cuda/cudnn_sdpa.py calls: a handle bound to a stream, a pygraph of tensors with UIDs,
sdpa and sdpa_backward, build, the workspace size and execute. It records the graph the backend builds
(tests read `pygraph.built`) and, on execute, computes numpy_ops' flash attention in bf16 (the oracle of
--attention cudnn) from the pointers and strides it is given, on the handle's stream: now, or at each
launch of the CUDA graph a capture records it into, like the simulator's cuBLAS.

Held to the real package: every function has the real one's parameter names and defaults (the subset the
backend uses; tests/test_cudnn_attention.py compares them with the installed package), and what the real
library refuses is refused here too: a tensor without a UID or with one taken, an output not marked as one,
float32 inputs, a graph executed before it is built, a pointer missing from execute's map or not 16-byte
aligned, a handle on another stream than the thread's.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import numpy as np
from fake_cupy import _bf16_bits, _memory, _queue, get_current_stream, raw_operation

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
from xtrain_dist.backend.numpy_ops import NumpyBackend

__version__ = "1.25.0 (cudasim)"
BACKEND_VERSION = 91300


class data_type(enum.IntEnum):
    FLOAT = 0
    DOUBLE = 1
    HALF = 2
    BFLOAT16 = 9
    NOT_SET = 18


class heur_mode(enum.IntEnum):
    A = 0
    B = 1
    FALLBACK = 2


class diagonal_alignment(enum.IntEnum):
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class tensor_reordering(enum.IntEnum):
    NONE = 0


class cudnnGraphNotSupportedError(RuntimeError):
    pass


_ITEM = {data_type.FLOAT: 4, data_type.BFLOAT16: 2, data_type.HALF: 2}
_handles: dict[int, int] = {}  # handle -> the stream it runs on


def backend_version() -> int:
    return BACKEND_VERSION


def create_handle() -> int:
    handle = 0x7D00 + len(_handles)
    _handles[handle] = 0
    return handle


def set_stream(handle: int, stream: int) -> None:
    _handles[handle] = stream


def get_stream(handle: int) -> int:  # the real one's parameter is positional (arg0)
    return _handles[handle]


def destroy_handle(handle: int) -> None:
    del _handles[handle]


class tensor:
    def __init__(self, graph, dim, stride, data_type, name, uid, is_output=False):
        self.graph, self.dim, self.stride, self.data_type, self.name = graph, dim, stride, data_type, name
        self.uid, self.is_output = uid, is_output

    def set_output(self, value):
        self.is_output = bool(value)
        return self

    def set_dim(self, value):
        self.dim = list(value)
        return self

    def set_stride(self, value):
        self.stride = list(value)
        return self

    def set_data_type(self, data_type=data_type.NOT_SET):
        self.data_type = data_type
        return self

    def set_name(self, value):
        self.name = value
        return self

    def set_uid(self, value):
        self.uid = int(value)
        return self

    def get_uid(self):
        return self.uid


class pygraph:
    def __init__(self, name="test_graph", io_data_type=data_type.NOT_SET, intermediate_data_type=data_type.NOT_SET,
                 compute_data_type=data_type.NOT_SET, handle=None):
        self.io_data_type, self.intermediate_data_type = io_data_type, intermediate_data_type
        self.compute_data_type, self.handle = compute_data_type, handle
        self.tensors: list[tensor] = []
        self.op: dict | None = None  # the one SDPA node, with its attributes
        self.built = False
        self.heur_modes: list = []

    def tensor(self, dim, stride, data_type=data_type.NOT_SET, is_virtual=False, is_pass_by_value=False,
               ragged_offset=None, reordering_type=tensor_reordering.NONE, name="", uid=-1,
               ragged_offset_multiplier=1):
        if is_virtual or is_pass_by_value or ragged_offset is not None:
            raise NotImplementedError("cudasim cudnn: only plain device tensors are modelled")
        t = tensor(self, list(dim), list(stride), data_type, name, uid)
        self.tensors.append(t)
        return t

    def _outputs(self, *names):
        outs = [tensor(self, None, None, self.io_data_type, name, -1) for name in names]
        self.tensors += outs
        return outs

    def _node(self, kind, **attributes):
        if self.op is not None:
            raise NotImplementedError("cudasim cudnn: one SDPA node a graph")
        self.op = {"kind": kind, **attributes}

    def sdpa(self, q, k, v, is_inference=None, attn_scale=None, use_causal_mask=False, name="",
             generate_stats=None):
        if is_inference is not None and generate_stats is not None and bool(is_inference) == bool(generate_stats):
            raise ValueError("cudnn sdpa: is_inference and generate_stats disagree")
        stats = generate_stats if generate_stats is not None else (is_inference is not None and not is_inference)
        self._node("sdpa", q=q, k=k, v=v, attn_scale=attn_scale, causal=use_causal_mask, generate_stats=stats)
        o, s = self._outputs(f"{name}::O", f"{name}::Stats")
        self.op.update(o=o, stats=s)
        return [o, s if stats else None]

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None, use_causal_mask=False,
                      use_deterministic_algorithm=False, name=""):
        self._node("sdpa_backward", q=q, k=k, v=v, o=o, dO=dO, stats=stats, attn_scale=attn_scale,
                   causal=use_causal_mask, deterministic=use_deterministic_algorithm)
        dq, dk, dv = self._outputs(f"{name}::dQ", f"{name}::dK", f"{name}::dV")
        self.op.update(dQ=dq, dK=dk, dV=dv)
        return [dq, dk, dv]

    # ------------------------------------------------------------------ building
    def _check(self) -> None:
        """What the real library's validate refuses, of what the backend could get wrong."""
        op = self.op
        if op is None:
            raise RuntimeError("cudnn: a graph without an operation")
        if self.io_data_type not in (data_type.BFLOAT16, data_type.HALF):
            raise cudnnGraphNotSupportedError("cudnn sdpa: 16-bit (or fp8) inputs only")
        uids = [t.uid for t in self.tensors]
        if any(uid < 0 for uid in uids) or len(set(uids)) != len(uids):
            raise RuntimeError(f"cudnn: every tensor needs a UID of its own, got {uids}")
        outputs = ("o", "stats") if op["kind"] == "sdpa" else ("dQ", "dK", "dV")
        for key in outputs:
            t = op[key]
            if not t.is_output or t.dim is None or t.stride is None:
                raise RuntimeError(f"cudnn: output {t.name} must be set_output(True) with its dim and stride")
        B, H, T, D = op["q"].dim
        for t in self.tensors:
            if t is op.get("stats"):
                ok = t.dim == [B, H, T, 1] and t.data_type == data_type.FLOAT
            else:
                ok = t.dim == [B, H, T, D] and t.data_type in (data_type.BFLOAT16, data_type.NOT_SET)
            if not ok or t.stride[-1] != 1:
                raise RuntimeError(f"cudnn: tensor {t.name}: dim {t.dim} stride {t.stride} type {t.data_type!r}")
        if D % 8 or D > 256:
            raise cudnnGraphNotSupportedError(f"cudnn sdpa: head size {D}")

    def validate(self):
        self._check()

    def build_operation_graph(self):
        self._check()

    def create_execution_plans(self, heur_modes):
        self.heur_modes = list(heur_modes)

    def check_support(self):
        self._check()

    def build_plans(self):
        self.built = True

    def build(self, heur_modes):  # the real one's list is positional (arg0)
        self.validate()
        self.create_execution_plans(heur_modes)
        self.built = True

    def get_workspace_size(self):
        if not self.built:
            raise RuntimeError("cudnn: get_workspace_size before build")
        B, H, T, _ = self.op["q"].dim
        return B * H * T * 4 if self.op["kind"] == "sdpa_backward" else 0  # the backward's float32 row dots

    # ------------------------------------------------------------------ running
    def execute(self, tensor_to_device_buffer, workspace, handle=None, override_uids=None, override_shapes=None,
                override_strides=None):
        if not self.built:
            raise RuntimeError("cudnn: execute before build")
        pointers = {(key if isinstance(key, int) else key.get_uid()): int(ptr)
                    for key, ptr in tensor_to_device_buffer.items()}
        missing = {t.uid for t in self.tensors} - set(pointers)
        if missing:
            raise RuntimeError(f"cudnn execute: no pointer for the tensors of UIDs {sorted(missing)}")
        if any(ptr % 16 for ptr in pointers.values()):
            raise RuntimeError("cudnn execute: a tensor not 16-byte aligned")
        stream = _handles[handle if handle is not None else self.handle]
        if stream != get_current_stream().ptr:
            raise AssertionError(f"cudnn execute on stream {stream:#x}, the thread's current one is "
                                 f"{get_current_stream().ptr:#x}")
        op, size = self.op, self.get_workspace_size()
        views = {key: _view(op[key], pointers[op[key].uid]) for key in op if isinstance(op[key], tensor)}

        def run():  # now, or at each launch of the graph a capture records it into
            stream_now = get_current_stream()
            written = ("o", "stats") if op["kind"] == "sdpa" else ("dQ", "dK", "dV")
            accesses = [(*_span(v), key in written) for key, v in views.items()]
            if size:
                accesses.append((workspace, workspace + size, True))
            raw_operation(stream_now, f"cudnn {op['kind']}", accesses)
            (_forward if op["kind"] == "sdpa" else _backward)(op, views)

        _queue(stream, run)


def _view(t: tensor, ptr: int) -> np.ndarray:
    """The strided host view of a tensor at `ptr` (the simulator's device memory is host memory)."""
    item = _ITEM[data_type.FLOAT if t.data_type == data_type.FLOAT else data_type.BFLOAT16]
    count = 1 + sum((n - 1) * s for n, s in zip(t.dim, t.stride, strict=True))
    flat = _memory(ptr, np.float32 if item == 4 else np.uint16, count)
    return np.lib.stride_tricks.as_strided(flat, t.dim, [s * item for s in t.stride], writeable=True)


def _span(a: np.ndarray) -> tuple[int, int]:
    lo = a.__array_interface__["data"][0]
    return lo, lo + sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=True)) + a.itemsize


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _tokens(bhtd: np.ndarray) -> np.ndarray:
    """(B, H, T, D) -> (B, T, H D) float32, as numpy_ops' token rows hold heads."""
    B, H, T, D = bhtd.shape
    return _f32(bhtd).transpose(0, 2, 1, 3).reshape(B, T, H * D)


def _store(view: np.ndarray, tokens: np.ndarray) -> None:
    B, H, T, D = view.shape
    view[...] = _bf16_bits(np.ascontiguousarray(tokens.reshape(B, T, H, D).transpose(0, 2, 1, 3), np.float32))


def _check_scale(op, D: int) -> None:
    if op["attn_scale"] is None or np.float32(op["attn_scale"]) != np.float32(1.0 / np.sqrt(D)) or not op["causal"]:
        raise AssertionError(f"cudasim cudnn: the oracle is causal attention scaled by 1/sqrt({D}), got "
                             f"attn_scale {op['attn_scale']} causal {op['causal']}")


def _forward(op, views) -> None:
    """numpy_ops' flash attention forward in bf16, the oracle --attention cudnn is held to."""
    *_, H, _, D = views["q"].shape
    _check_scale(op, D)
    qkv = np.concatenate([_tokens(views[key]) for key in ("q", "k", "v")], axis=-1)
    out, lse = NumpyBackend("bf16").flash_attention_forward(qkv, H)
    _store(views["o"], out)
    if op["generate_stats"]:
        views["stats"][...] = lse[..., None]


def _backward(op, views) -> None:
    *_, H, _, D = views["q"].shape
    _check_scale(op, D)
    qkv = np.concatenate([_tokens(views[key]) for key in ("q", "k", "v")], axis=-1)
    dqkv = NumpyBackend("bf16").flash_attention_backward(_tokens(views["dO"]), qkv, _tokens(views["o"]),
                                                         np.array(views["stats"][..., 0]), H)
    C = H * D
    for i, key in enumerate(("dQ", "dK", "dV")):
        _store(views[key], dqkv[..., i * C:(i + 1) * C])


def install() -> None:
    """`import cudnn` gives this module."""
    sys.modules["cudnn"] = sys.modules[__name__]


def block() -> None:
    """`import cudnn` fails, as where the package is not installed (whether or not this machine has it)."""
    sys.modules["cudnn"] = None
