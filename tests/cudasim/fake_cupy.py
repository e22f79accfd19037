"""A stand-in for CuPy under which xtrain_dist.backend.cuda runs its real kernels on the CPU.

`install()` puts modules named `cupy`, `cupy.cuda` and `cupy_backends.cuda.libs.cublas` in
sys.modules (tests/conftest.py does so when XTRAIN_CUDASIM=1). Then:

- Kernels. `RawModule(code=..., options=...)` compiles the text the backend hands to NVRTC with g++ and
  cudasim.h force-included (one fiber per CUDA thread, see there), once per text and options (cached on
  disk). A launch checks what CuPy and the driver cannot: the number of arguments and each one's kind
  against the kernel's parameters (a pointer for an array or None, int32 for `int`, int64 for
  `long long`, float32 for `float`, ...), the grid and block limits, and afterwards the guard bytes
  around every array it was given (a write past either end is an error naming the argument).
- Arrays. `ndarray` is a numpy subclass living in ordinary memory, with CuPy's `.data.ptr`, `.get()`
  and `.set()`. Allocations start on 256-byte boundaries, as CuPy's pool gives, and are filled with
  0xFF bytes (NaN as float32), as the GPU tests' poisoned allocator does, so an output element a
  kernel forgets to write is seen; so are the 64 guard bytes on each side, so a read just outside
  the array gives NaN. Ufuncs that mix one with a host numpy array fail, as in CuPy.
- cuBLAS. CuPy's binding (`cupy_backends.cuda.libs.cublas`) points the handle at the current stream
  before each product and on `cupy.cuda.device.get_cublas_handle()`, and refuses to while that stream
  captures (NotImplementedError, CuPy 14.2's words), so a product through CuPy cannot go into a graph,
  as on a GPU; the backend's own ctypes binding (fake_cublas.py stands in for its library) can. gemmEx
  and gemmStridedBatchedEx read their operands from memory with the column-major conventions of the real
  library (op, leading dimensions, strides), check that the type combination is one cuBLAS supports, and
  compute in float32 (numpy's BLAS), rounding once to the output type (bf16 outputs to nearest even);
  TF32 compute rounds float32 operands to TF32 first. A bf16 output with beta != 0 is rounded twice, the
  product to bf16 before C is added, as cuBLAS 13 did on an H100 (kernels/matmul.cu).
- Streams and events. Every operation runs to completion when it is queued (event times are host
  times), so streams never overlap here; but every operation tells streams.py which bytes it reads
  and writes on which stream, and an access that no stream order, event or host synchronisation
  orders after a conflicting one on another stream is an error (`StreamRace`): a missing fence is
  found although nothing here ran concurrently.
- Graphs. `Stream.begin_capture()` makes the work queued on that stream (and on streams that wait for an
  event recorded on it: cross-stream capture) be recorded instead of run; `end_capture()` returns a graph
  whose `launch(stream)` runs the recorded work in the order it was queued, as work of the launching
  stream. What a GPU refuses while a stream captures is an error here too: a copy to the host that
  waits (get, item, float), a copy from pageable host memory (set), synchronizing the stream, an event
  recorded in the capture or the device, and an allocation that would be a cudaMalloc: one of a size
  the thread's allocator (a `MemoryPool` made current with `using_allocator`) has not handed out before
  the capture (the warm-up step that fills a graph's pool).

It is a test instrument, not a backend: nothing in xtrain_dist imports it, and a run that asks for
--backend cuda without CuPy still fails. What it cannot see is listed in cudasim.h.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import hashlib
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import streams
from streams import StreamRace  # noqa: F401  (what a test catches)

HERE = Path(__file__).resolve().parent
ALIGN = 256          # CuPy's pool hands out 256-byte aligned blocks; _vec's 16- and 32-byte tests see the same
GUARD = 64           # guard bytes on either side of every allocation
# Guard bytes and fresh allocations are 0xFF: NaN as float32 and as bf16, so a read just outside an array
# (or of an element nobody wrote) turns the result into NaN, which the tests' finiteness checks catch, and
# a write outside changes bytes the launch checks afterwards.
GUARD_BYTE = 0xFF
POISON_BYTE = 0xFF
_GUARDS = bytes([GUARD_BYTE]) * (2 * GUARD + ALIGN)  # longer than either side's guard bytes (_allocate)
CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall",
             "-Wno-unknown-pragmas")


def cxx_flags() -> tuple[str, ...]:
    """CXX_FLAGS, or with XTRAIN_CUDASIM_DEBUG=1 unoptimised with debug information, for a debugger:
    `gdb --args python tests/cudasim/run.py ...`, `directory kernels`, `break layernorm.cu:40`."""
    if os.environ.get("XTRAIN_CUDASIM_DEBUG") == "1":
        return (*("-O0" if f == "-O2" else f for f in CXX_FLAGS), "-g")
    return CXX_FLAGS


def order() -> int:
    """XTRAIN_CUDASIM_ORDER: forward (default), reverse, or a seed (>= 2) for a shuffled resume order."""
    text = os.environ.get("XTRAIN_CUDASIM_ORDER", "forward")
    named = {"forward": 0, "reverse": 1}
    if text in named:
        return named[text]
    if text.isdigit() and int(text) >= 2:
        return int(text)
    raise ValueError(f"XTRAIN_CUDASIM_ORDER={text!r}: use forward, reverse or a seed >= 2")


# ---------------------------------------------------------------------------- host traffic

# What crossed between host and device, and where the host waited for the device, in order, per thread
# name: upload (a host array copied in: set, asarray of a host array), download (get, item, float),
# stream_sync, event_sync, device_sync. CuPy has no hook for these; tests read them to hold the training
# step to the copies it means to make (tests/test_cuda_ops.py, tests/test_nccl.py).
host_traffic_by_thread: dict[str, list[str]] = collections.defaultdict(list)


def host_traffic() -> list[str]:
    """The calling thread's log (by its name: a rank thread's is `host_traffic_by_thread["rank0"]`)."""
    return host_traffic_by_thread[threading.current_thread().name]


def training_traffic(steps: int, uploads: int) -> str:
    """A rank thread's whole log, joined by spaces, as a regular expression of what a training run may do:
    setup uploads; per optimizer step `uploads` uploads, the launch of the step's graph where it runs from
    one (--cuda-graph), and the step's one download, queued on the stream (the host does not wait for it
    there); from the second step on, after that, the waits for the previous step's download and timing
    marks (the host reads a step once the next one is queued, so it never waits for the step it has just
    queued); then the last step's own waits and the end of the run, which starts with a download (the
    parameter digest)."""
    first = rf"(?:upload ){{{uploads}}}(?:graph_launch )?download_queued "
    step = rf"(?:upload ){{{uploads}}}(?:graph_launch )?download_queued(?: event_sync)+ "
    return rf"(?:upload )*{first}(?:{step}){{{steps - 1}}}(?:event_sync )*download(?: .*)?"


# ---------------------------------------------------------------------------- memory

class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


# root buffer id -> (weak reference to it, offset of the data, bytes of data, address of the data)
_allocations: dict[int, tuple[weakref.ref, int, int, int]] = {}
_allocations_lock = threading.RLock()  # re-entrant: a weakref callback (_forget) may run inside a locked block
# bytes of the arrays alive now, and the most alive at once since the pool last gave its free blocks back:
# CuPy's pool keeps every freed block for reuse, so what it holds from the driver is that high-water mark
_live_bytes = 0
_held_bytes = 0


def _forget(key: int) -> None:
    global _live_bytes
    with _allocations_lock:
        entry = _allocations.pop(key, None)
        if entry is not None:
            _live_bytes -= entry[2]
    if entry is not None:
        streams.freed(entry[3])


def _allocate(shape, dtype, fill: int | None = POISON_BYTE) -> ndarray:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    pool = getattr(_thread, "pool", None)
    if get_current_stream().capture is not None:
        if pool is None or -(-nbytes // ALIGN) not in pool.sizes:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: cudasim: an allocation of {nbytes} bytes "
                                   "during stream capture that the pool has no block for (a cudaMalloc): "
                                   "allocate it before the capture, or warm the graph's pool with the same step")
    elif pool is not None:
        pool.sizes.add(-(-nbytes // ALIGN))
    raw = np.empty(nbytes + 2 * GUARD + ALIGN, np.uint8)
    capture = get_current_stream().capture
    if capture is not None:  # the graph's pool owns what the capture allocated, for every launch of the graph
        capture.held.append(raw)
    start = -raw.ctypes.data % ALIGN + GUARD
    raw[:] = GUARD_BYTE
    if fill is not None and fill != GUARD_BYTE:
        raw[start:start + nbytes] = fill
    key = id(raw)
    address = raw.ctypes.data + start
    global _live_bytes, _held_bytes
    with _allocations_lock:
        _allocations[key] = (weakref.ref(raw, lambda _: _forget(key)), start, nbytes, address)
        _live_bytes += nbytes
        _held_bytes = max(_held_bytes, _live_bytes)
    streams.allocated(address, nbytes, get_current_stream())
    return raw[start:start + nbytes].view(dtype).reshape(shape).view(ndarray)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _check_guards(a: np.ndarray) -> str | None:
    root = _root(a)
    with _allocations_lock:
        entry = _allocations.get(id(root))
    if entry is None or entry[0]() is not root:
        return None
    _, start, nbytes, _ = entry
    # bytes against bytes: a comparison of two numpy slices was 10 us a launch argument, this 0.7
    if root[:start].tobytes() != _GUARDS[:start]:
        return "before its start"
    if root[start + nbytes:].tobytes() != _GUARDS[:root.size - start - nbytes]:
        return "past its end"
    return None


def _span(a: np.ndarray) -> tuple[int, int]:
    """The first and the end address of the bytes a (possibly strided) view covers."""
    lo = hi = a.__array_interface__["data"][0]
    if a.size == 0:
        return lo, lo
    for n, stride in zip(a.shape, a.strides, strict=True):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + a.itemsize


def _on_stream(what: str, reads=(), writes=(), stream=None) -> None:
    """Tell streams.py about one operation on `stream` (the calling thread's current one by default)
    that reads and writes these device arrays."""
    accesses = [(*_span(a), False) for a in reads if isinstance(a, ndarray)]
    accesses += [(*_span(a), True) for a in writes if isinstance(a, ndarray)]
    streams.operation(getattr(_thread, "launching", None) or stream or get_current_stream(), what, accesses)


def raw_operation(stream, what: str, accesses) -> None:
    """An operation on raw addresses ((first, end, writes?) triples: cuBLAS, NCCL, the runtime's copies)
    on a stream given as a Stream or as its handle."""
    stream = getattr(_thread, "launching", None) or _stream_of(stream)
    streams.operation(stream, what, accesses)


def _stream_of(stream) -> Stream:
    """A Stream given as itself or as its handle (None: the calling thread's current one)."""
    if stream is None:
        return get_current_stream()
    if not isinstance(stream, Stream):
        stream = streams.stream_at(int(stream or 0)) or Stream.null
    return stream


# ---------------------------------------------------------------------------- graphs (stream capture)

_capturing: set = set()  # the graphs being captured now, by any thread


class Graph:
    """The work a capture recorded, in the order it was queued; launch() runs it on the launching stream."""

    def __init__(self, origin):
        self.origin = origin
        self.streams = [origin]  # the origin and the streams that joined through an event
        self.work: list = []     # (the stream it was queued on, what runs it)
        # the memory allocated during the capture: a kernel's closure holds its arrays, but a library call
        # (cuBLAS, cuBLASLt) holds only addresses, and an array only such calls touch (the GELU epilogue's
        # outputs) would otherwise be freed under the graph, where CUDA's graph pool keeps it
        self.held: list = []
        self.lock = threading.Lock()

    def record(self, stream, run) -> None:
        with self.lock:
            self.work.append((stream, run))

    def launch(self, stream=None) -> None:
        stream = _stream_of(stream)
        if self in _capturing:
            raise CUDARuntimeError("cudaErrorIllegalState: cudasim: a graph launched before its capture ended")
        _refuse_in_capture(stream, "a graph launch into a stream that captures")
        before = getattr(_thread, "stream", Stream.null), getattr(_thread, "launching", None)
        _thread.launching = stream  # everything runs as the launching stream's work, in recorded order
        try:
            for queued_on, run in self.work:
                _thread.stream = queued_on  # what the recorded call saw as the current stream
                run()
        finally:
            _thread.stream, _thread.launching = before
        host_traffic().append("graph_launch")


def _queue(stream, run) -> None:
    """Run an operation queued on `stream` (a Stream, a handle, None for the current one) now, or record it
    into the graph that stream is capturing."""
    target = _stream_of(stream)
    if target.capture is None or getattr(_thread, "launching", None) is not None:
        run()
    else:
        target.capture.record(target, run)


def _refuse_in_capture(stream, what: str) -> None:
    if getattr(_stream_of(stream), "capture", None) is not None:
        raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: cudasim: {what} while the stream captures")


class ndarray(np.ndarray):
    """A device array of the simulator: numpy memory with CuPy's handles on it. What would be a kernel
    or a copy on the GPU runs here at once, and tells streams.py what it read and wrote on which stream."""

    @property
    def data(self):  # CuPy: a MemoryPointer whose .ptr is the device address
        return _Pointer(self.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self) -> dict:  # what tells code that an array lives on a device
        host = self.__array_interface__
        return {"shape": host["shape"], "typestr": host["typestr"], "data": host["data"],
                "strides": host["strides"], "version": 3}

    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        stream = stream or get_current_stream()
        _refuse_in_capture(stream, "a copy to the host that waits for it (ndarray.get, item, float)")
        if not self.flags.c_contiguous:
            # CuPy copies a strided array into a contiguous one under `with stream:` first, and leaving that
            # block makes the null stream current (see Stream.__exit__), whatever stream was current before
            with stream:
                pass
        _on_stream("a copy to the host (ndarray.get)", reads=[self], stream=stream)
        host_traffic().append("download")
        streams.host_saw(streams.recorded(stream))  # CuPy's get waits for the stream
        return np.array(self.view(np.ndarray), order=order)

    def set(self, arr, stream=None) -> None:
        arr = np.asarray(arr)
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        _refuse_in_capture(stream or get_current_stream(), "a copy from pageable host memory (ndarray.set)")
        _on_stream("a copy from the host (ndarray.set)", writes=[self], stream=stream)
        host_traffic().append("upload")
        self.view(np.ndarray)[...] = arr

    # a value read on the host: CuPy copies it out on the current stream and waits
    def item(self, *args):
        return self.get().item(*args)

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())

    def tolist(self):
        return self.get().tolist()

    def __setitem__(self, key, value) -> None:
        def run():
            target = np.ndarray.__getitem__(self, key)
            _on_stream("an assignment (ndarray.__setitem__)", reads=[value],
                       writes=[target if isinstance(target, np.ndarray) else self])
            np.ndarray.__setitem__(self.view(np.ndarray), key, _host(value))

        _queue(None, run)

    def fill(self, value) -> None:
        def run():
            _on_stream("ndarray.fill", writes=[self])
            self.view(np.ndarray).fill(value)

        _queue(None, run)

    def copy(self, order="C"):
        return _from(self, what="ndarray.copy")

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _from(self, dtype, what="ndarray.astype")

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        for x in inputs + (out or ()):
            if type(x) is np.ndarray and x.ndim > 0:
                raise TypeError(f"cudasim: {ufunc.__name__} mixes a device array with a host numpy array "
                                "(CuPy refuses: Unsupported type <class 'numpy.ndarray'>)")
        what = f"cupy.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        plain = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs)
        if out is not None or method == "at":
            written = list(out or ()) + ([inputs[0]] if method == "at" else [])

            def run():
                _on_stream(what, reads=inputs, writes=written)
                if out is not None:
                    kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in out)
                getattr(ufunc, method)(*plain, **kwargs)

            _queue(None, run)
            return None if out is None else out[0] if len(out) == 1 else out
        # a new array: computed now, which changes nothing; in a capture, computed again at each launch
        # into the array allocated now
        result = getattr(ufunc, method)(*plain, **kwargs)
        stream = get_current_stream()
        if stream.capture is None:
            _on_stream(what, reads=inputs)
            return tuple(_wrap(r) for r in result) if isinstance(result, tuple) else _wrap(result)
        fresh = result if isinstance(result, tuple) else (result,)
        results = tuple(_allocate(np.shape(r), np.asarray(r).dtype) for r in fresh)

        def again():
            _on_stream(what, reads=inputs, writes=results)
            values = getattr(ufunc, method)(*plain, **kwargs)
            for r, v in zip(results, values if isinstance(values, tuple) else (values,), strict=True):
                r.view(np.ndarray)[...] = v

        stream.capture.record(stream, again)
        return results if isinstance(result, tuple) else results[0]


def _wrap(x):
    """A ufunc's result as a fresh device array (tracked like every allocation; a scalar as a 0-d array,
    as CuPy's reductions give)."""
    if isinstance(x, (np.ndarray, np.generic)) and not isinstance(x, ndarray):
        return _from(x, what="a ufunc's result")
    return x


def _host(x):
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _from(values, dtype=None, what="a copy to the device", compute=None) -> ndarray:
    """A new device array holding values (a host or device array, or a scalar). In a capture, what fills
    it runs at each launch: compute() (values from device arrays, computed again then) or the copy."""
    source = values
    values = np.asarray(_host(values), dtype=dtype)
    out = _allocate(values.shape, values.dtype)
    stream = get_current_stream()

    def fill(fresh=values):
        _on_stream(what, reads=[source], writes=[out])
        out.view(np.ndarray)[...] = fresh

    if stream.capture is None:
        fill()
    else:
        if not isinstance(source, ndarray) and compute is None and np.ndim(source) > 0:
            _refuse_in_capture(stream, f"{what} from pageable host memory")
        stream.capture.record(stream, (lambda: fill(np.asarray(compute(), dtype=dtype))) if compute else
                              (lambda: fill(np.asarray(_host(source), dtype=dtype))))
    return out


def empty(shape, dtype=np.float64, order="C"):
    return _allocate(shape, dtype)


def full(shape, fill_value, dtype=None):
    out = _allocate(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)

    def run():
        _on_stream("a fill (cupy.full, zeros, ones)", writes=[out])
        out.view(np.ndarray)[...] = fill_value

    _queue(None, run)
    return out


def zeros(shape, dtype=np.float64, order="C"):
    return full(shape, 0, dtype)


def ones(shape, dtype=np.float64):
    return full(shape, 1, dtype)


def empty_like(a, dtype=None):
    return _allocate(a.shape, dtype or a.dtype)


def zeros_like(a, dtype=None):
    return full(a.shape, 0, dtype or a.dtype)


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return array(a, dtype)


def array(a, dtype=None, copy=True):
    if not isinstance(a, ndarray):
        host_traffic().append("upload")
    return _from(a, dtype)


def argsort(a, axis=-1, kind=None):
    def compute():
        _on_stream("cupy.argsort", reads=[a])
        return np.argsort(_host(a), axis=axis, kind="stable")

    return _from(compute(), what="cupy.argsort", compute=compute)


def concatenate(arrays, axis=0):
    def compute():
        _on_stream("cupy.concatenate", reads=arrays)
        return np.concatenate([_host(a) for a in arrays], axis=axis)

    return _from(compute(), what="cupy.concatenate", compute=compute)


def matmul(a, b):
    def compute():
        _on_stream("cupy.matmul", reads=[a, b])
        return np.matmul(_host(a), _host(b))

    return _from(compute(), what="cupy.matmul", compute=compute)


def _numpy_fallback(name: str):
    """Any other cupy.<name>: numpy's, with device arrays in and out."""
    target = getattr(np, name)
    if isinstance(target, type) or not callable(target):
        return target

    def call(*args, **kwargs):
        def compute():
            _on_stream(f"cupy.{name}", reads=[*args, *kwargs.values()])
            return target(*(_host(a) for a in args), **{k: _host(v) for k, v in kwargs.items()})

        result = compute()
        if isinstance(result, np.ndarray):
            return _from(result, what=f"cupy.{name}", compute=compute)
        _refuse_in_capture(get_current_stream(), f"cupy.{name} giving a host value")
        return result

    return call


# ---------------------------------------------------------------------------- devices, streams, events

class CUDARuntimeError(RuntimeError):
    pass


def device_count() -> int:
    return int(os.environ.get("XTRAIN_CUDASIM_DEVICES", "1"))


def _mem_get_info():
    """(free, total) of the current simulated GPU: XTRAIN_CUDASIM_MEMORY bytes (default 80 GiB, an H100's),
    all free. The arrays live in host memory, so this is only what the pre-flight memory check reads."""
    total = int(os.environ.get("XTRAIN_CUDASIM_MEMORY", 80 << 30))
    return total, total


_thread = threading.local()
_stream_ids = itertools.count(0x1000, 0x10)


class Device:
    def __init__(self, device: int = 0):
        if not 0 <= int(device) < device_count():
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self.id = int(device)

    def use(self):
        _thread.device = self.id

    def __enter__(self):
        self._previous = getattr(_thread, "device", 0)
        self.use()
        return self

    def __exit__(self, *exc):
        _thread.device = self._previous

    def synchronize(self):
        _device_synchronize()


def _device_synchronize():
    if _capturing:
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: cudasim: a device synchronize while a stream "
                               "captures")
    host_traffic().append("device_sync")
    streams.host_saw_all()


class Stream(streams.Clocked):
    """A stream: which thread uses it, and its clock in streams.py. `non_blocking=False` (CuPy's default)
    is a blocking stream, ordered with the legacy null stream both ways."""

    def __init__(self, null: bool = False, non_blocking: bool = False):
        super().__init__(0 if null else next(_stream_ids), blocking=null or not non_blocking)
        self.capture: Graph | None = None  # the graph this stream's work goes into while it captures

    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: cudasim: the legacy null stream cannot "
                                   "capture")
        if self.capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: cudasim: the stream is capturing already")
        self.capture = Graph(self)
        _capturing.add(self.capture)

    def end_capture(self):
        graph = self.capture
        if graph is None or graph.origin is not self:
            raise CUDARuntimeError("cudaErrorIllegalState: cudasim: end_capture on a stream that did not begin one")
        for stream in graph.streams:
            stream.capture = None
        _capturing.discard(graph)
        return graph

    def is_capturing(self) -> bool:
        return self.capture is not None

    def use(self):
        _thread.stream = self
        return self

    # CuPy keeps a stack of the streams entered with `with`, apart from use(): leaving the outermost one
    # makes the null stream current, not the stream use() had made current (measured on CuPy 14.2, H100)
    def __enter__(self):
        _with_stack().append(self)
        return self.use()

    def __exit__(self, *exc):
        stack = _with_stack()
        stack.pop()
        _thread.stream = stack[-1] if stack else Stream.null

    def synchronize(self):
        _refuse_in_capture(self, "a stream synchronize")
        host_traffic().append("stream_sync")
        streams.host_saw(streams.recorded(self))

    def wait_event(self, event):
        if event.capture is not None and self.capture is None:  # cross-stream capture: this stream joins
            self.capture = event.capture
            event.capture.streams.append(self)
        streams.wait(self, event.clock)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event


Stream.null = Stream(null=True)


def _with_stack() -> list:
    if not hasattr(_thread, "with_stack"):
        _thread.with_stack = []
    return _thread.with_stack


def get_current_stream(device=None):
    return getattr(_thread, "stream", Stream.null)


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.disable_timing = disable_timing
        self.time = None
        self.clock: dict[int, int] = {}  # an event never recorded orders nothing
        self.capture: Graph | None = None  # recorded into a graph: it joins the streams that wait for it

    def record(self, stream=None):
        stream = stream or get_current_stream()
        self.capture = stream.capture
        self.clock = streams.recorded(stream)
        self.time = time.perf_counter()

    def synchronize(self):
        if self.capture is not None and self.capture in _capturing:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: cudasim: waiting on the host for an event "
                                   "recorded in a stream capture")
        host_traffic().append("event_sync")
        streams.host_saw(self.clock)

    @property
    def done(self):  # True at once, and orders nothing (see streams.py: the watchdog polls it)
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    if start.disable_timing or end.disable_timing:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: an event made with disable_timing")
    return (end.time - start.time) * 1e3


_handles = threading.local()
_handle_ids = itertools.count(1)
_handle_streams: dict[int, int] = {}  # handle -> the stream pointer its products run on (0: the null stream)
CUBLAS_IN_CAPTURE = "calling cuBLAS API during stream capture is currently unsupported"  # CuPy 14.2's words


def _set_handle_stream(handle: int, stream_ptr: int) -> None:
    """cublas.setStream, with CuPy's check before it: no stream may be set while that stream captures."""
    if _stream_of(stream_ptr).is_capturing():
        raise NotImplementedError(CUBLAS_IN_CAPTURE)
    _handle_streams[handle] = stream_ptr


def get_cublas_handle():
    """CuPy's handle of the calling thread, pointed at the current stream on every call."""
    if not hasattr(_handles, "handle"):
        _handles.handle = next(_handle_ids)
    _set_handle_stream(_handles.handle, get_current_stream().ptr)
    return _handles.handle


class MemoryPool:
    """A pool of its own (CuPy's MemoryPool): made the thread's allocator with using_allocator(pool.malloc),
    it remembers the block sizes it handed out, which are the allocations a later capture may make."""

    def __init__(self):
        self.sizes: set[int] = set()  # in ALIGN-byte units

    def malloc(self, size):
        return _allocate(size, np.uint8).data


class using_allocator:  # CuPy's name
    """The calling thread allocates from `allocator` (a MemoryPool's malloc) inside the block."""

    def __init__(self, allocator=None):
        self.pool = getattr(allocator, "__self__", None)

    def __enter__(self):
        self.previous = getattr(_thread, "pool", None)
        _thread.pool = self.pool

    def __exit__(self, *exc):
        _thread.pool = self.previous


class _MemoryPool:
    def malloc(self, size):
        return _allocate(size, np.uint8).data

    def free_all_blocks(self):
        global _held_bytes
        with _allocations_lock:
            _held_bytes = _live_bytes

    def used_bytes(self):
        return _live_bytes

    def total_bytes(self):
        return _held_bytes


_pool = _MemoryPool()


# ---------------------------------------------------------------------------- kernels

def _cache_dir() -> Path:
    path = Path(os.environ.get("XTRAIN_CUDASIM_CACHE", Path(tempfile.gettempdir()) / f"xtrain-cudasim-{os.getuid()}"))
    path.mkdir(parents=True, exist_ok=True)
    return path


_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
_libraries: dict[str, ctypes.CDLL] = {}
_compile_lock = threading.Lock()
_launch_lock = threading.Lock()  # one launch at a time: the runtime's thread indices are process globals


@contextlib.contextmanager
def _file_lock(path: Path):
    """Hold an exclusive lock on PATH (created if missing) while the block runs: the simulator's test modules
    run in processes side by side, and each would otherwise compile the same kernels at the same time."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _made_once(target: Path, make) -> None:
    """make() creates `target` in the cache unless it is there, under a lock beside it (_file_lock): where
    another process is making the same one, this waits for it."""
    if not target.exists():
        with _file_lock(target.with_name(target.name + ".lock")):
            if not target.exists():
                make()


def _gxx_library(arguments: list[str], work: Path, target: Path, what: str = "") -> None:
    """g++ `arguments` into a library in `work`, moved to `target` (atomic: a concurrent build of the same text
    writes the same bytes); then `work` goes (#line directives point a debugger at kernels/ itself)."""
    partial = work / "out.so"
    result = subprocess.run(["g++", *arguments, "-o", str(partial)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cudasim: g++ failed{what}:\n{result.stderr}")
    os.replace(partial, target)
    shutil.rmtree(work, ignore_errors=True)


def _precompiled_header(header: str, flags: tuple[str, ...]) -> Path:
    """cudasim.h, precompiled once per text (its own and the headers it includes, `header`) and flags into
    the cache (<key>/cudasim.h beside its .gch), for `-include`: g++ spends most of a small kernel file's
    compile on the runtime's C++ headers, and every variant of a kernel file (backend/cuda/flash_variants.py)
    is a file of its own. g++ takes the .gch where the flags match and reads the header itself where they do
    not, so a stale or foreign one costs time, not bits."""
    key = hashlib.sha256("\0".join([*flags, header]).encode()).hexdigest()[:24]
    folder = _cache_dir() / f"pch-{key}"

    def make():
        work = Path(tempfile.mkdtemp(prefix="pch-build-", dir=_cache_dir()))
        shutil.copy(HERE / "cudasim.h", work / "cudasim.h")
        result = subprocess.run(["g++", *(f for f in flags if f != "-shared"), "-x", "c++-header",
                                 f"-I{HERE / 'include'}", str(work / "cudasim.h"), "-o",
                                 str(work / "cudasim.h.gch")], capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            os.replace(work, folder)  # atomic: the header appears with its .gch beside it

    _made_once(folder, make)
    return folder / "cudasim.h" if folder.exists() else HERE / "cudasim.h"  # no precompiled header: the plain one


def _runtime_library(header: str, flags: tuple[str, ...]) -> Path:
    """cudasim.h's runtime (its CUDASIM_RUNTIME part), compiled once per text and flags into the cache as a
    library that every kernel library links against by its path: loading a kernel library loads it, once
    for the process, so all kernels share one scheduler, one launch state and one set of threadIdx and the
    other built-in variables."""
    key = hashlib.sha256("\0".join(["runtime", *flags, header]).encode()).hexdigest()[:24]
    target = _cache_dir() / f"runtime-{key}.so"

    def make():
        work = Path(tempfile.mkdtemp(prefix="runtime-build-", dir=_cache_dir()))
        (work / "runtime.cpp").write_text('#define CUDASIM_RUNTIME 1\n#include "cudasim.h"\n')
        _gxx_library([*flags, f"-I{HERE}", str(work / "runtime.cpp")], work, target, " on the runtime")

    _made_once(target, make)
    return target


def _shared_library(code: str, options: tuple[str, ...]) -> tuple[ctypes.CDLL, list[str]]:
    """Compile `code` (what NVRTC would get) with g++ into a cached shared library."""
    names = _KERNEL.findall(code)
    defines = [o for o in options if o.startswith(("-D", "-U"))]
    header = (HERE / "cudasim.h").read_text() + "".join(
        (HERE / "include" / name).read_text() for name in ("mma.h", "cuda_bf16.h", "cudasim_ptx.h"))
    flags = cxx_flags()
    key = hashlib.sha256("\0".join([code, *defines, *flags, header]).encode()).hexdigest()[:24]
    with _compile_lock:
        if key in _libraries:
            return _libraries[key], names
    target = _cache_dir() / f"{key}.so"
    _made_once(target, lambda: _compile(code, names, defines, flags, target, _precompiled_header(header, flags),
                                        _runtime_library(header, flags)))
    with _compile_lock:
        if key not in _libraries:
            _libraries[key] = ctypes.CDLL(str(target))
        return _libraries[key], names


def _compile(code: str, names: list[str], defines: list[str], flags: tuple[str, ...], target: Path,
             prefix: Path, runtime: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="build-", dir=_cache_dir()))
    (work / "kernels.cuh").write_text(code)
    glue = ['#include "kernels.cuh"'] + [
        f'extern "C" int cudasim_launch_{n}(const unsigned* g, const unsigned* b, void** a, '
        f'unsigned long long o, char* e, int es) {{ return cudasim::launch({n}, g, b, a, o, e, es); }}\n'
        f'extern "C" const char* cudasim_signature_{n}() {{ static const std::string s = '
        f'cudasim::signature({n}); return s.c_str(); }}' for n in names]
    (work / "glue.cpp").write_text("\n".join(glue) + "\n")
    _gxx_library([*flags, *defines, f"-I{HERE / 'include'}", f"-I{work}", "-include", str(prefix),
                  str(work / "glue.cpp"), str(runtime)], work, target)


_CTYPES = {"i4": ctypes.c_int32, "i8": ctypes.c_int64, "u4": ctypes.c_uint32, "u8": ctypes.c_uint64,
           "f4": ctypes.c_float, "f8": ctypes.c_double, "i2": ctypes.c_int16, "u2": ctypes.c_uint16,
           "i1": ctypes.c_int8, "u1": ctypes.c_uint8}


def _kind_of(value) -> str:
    """What CuPy would pass for an argument: p (a pointer), or the kind of a scalar of that numpy type."""
    if value is None or isinstance(value, ndarray):
        return "p"
    if isinstance(value, np.ndarray):
        raise TypeError(f"Unsupported type {type(value)} (a host numpy array passed to a kernel)")
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i8"  # CuPy passes Python ints as int64 and floats as float64
    if isinstance(value, float):
        return "f8"
    if isinstance(value, np.generic):
        dt = np.dtype(type(value))
        return {"i": "i", "u": "u", "f": "f"}.get(dt.kind, "?") + str(dt.itemsize)
    raise TypeError(f"Unsupported type {type(value)}")


class Function:
    def __init__(self, library: ctypes.CDLL, name: str):
        self.name = name
        self._launch = getattr(library, f"cudasim_launch_{name}")
        self._launch.restype = ctypes.c_int
        signature = getattr(library, f"cudasim_signature_{name}")
        signature.restype = ctypes.c_char_p
        params = [p for p in signature().decode().split(",") if p]
        self.writes = [p == "p" for p in params]  # "pc": a pointer to const, which the kernel only reads
        self.max_dynamic_shared_size_bytes = 0  # CuPy's Function attribute (cuFuncSetAttribute)
        self.params = ["p" if p == "pc" else p for p in params]

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if (block[0] > 1024 or block[1] > 1024 or block[2] > 64 or block[0] * block[1] * block[2] > 1024
                or grid[0] > 2**31 - 1 or grid[1] > 65535 or grid[2] > 65535 or 0 in grid + block):
            raise CUDARuntimeError(f"cudaErrorInvalidConfiguration: {self.name} grid {grid} block {block}")
        # as the driver: dynamic shared memory past 48 KB only where the kernel was opted into it
        if shared_mem > 48 * 1024 and shared_mem > self.max_dynamic_shared_size_bytes:
            raise CUDARuntimeError(f"cudaErrorInvalidValue: {self.name} asks for {shared_mem} bytes of dynamic "
                                   f"shared memory, past 48 KB without max_dynamic_shared_size_bytes set")
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError(f"cudasim: {self.name} takes {len(self.params)} arguments, got {len(args)}")
        holders = []
        for i, (value, want) in enumerate(zip(args, self.params, strict=True)):
            got = _kind_of(value)
            if got != want:
                raise TypeError(f"cudasim: {self.name} argument {i} is {got} ({type(value).__name__}), the kernel's "
                                f"parameter is {want}")
            if want == "p":
                holders.append(ctypes.c_void_p(None if value is None else value.data.ptr))
            else:
                holders.append(_CTYPES[want](value.item() if isinstance(value, np.generic) else value))
        _queue(stream, lambda: self._run(grid, block, args, holders, stream))

    def _run(self, grid, block, args, holders, stream) -> None:
        _on_stream(f"kernel {self.name}", stream=stream,
                   reads=[a for a, w in zip(args, self.writes, strict=True) if not w],
                   writes=[a for a, w in zip(args, self.writes, strict=True) if w])
        pointers = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        error = ctypes.create_string_buffer(4096)
        with _launch_lock:
            failed = self._launch((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), pointers,
                                  ctypes.c_ulonglong(order()), error, ctypes.c_int(len(error)))
        if failed:
            raise CUDARuntimeError(f"cudaErrorLaunchFailure: cudasim: {self.name}: {error.value.decode()}")
        for i, value in enumerate(args):
            if isinstance(value, ndarray):
                where = _check_guards(value)
                if where is not None:
                    raise CUDARuntimeError(f"cudaErrorIllegalAddress: cudasim: {self.name} wrote {where} of the "
                                           f"allocation behind argument {i}")


def _dims(dims, what: str) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in (dims if isinstance(dims, tuple) else (dims,)))
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"cudasim: {what} must have 1 to 3 dimensions, got {dims}")
    return dims + (1,) * (3 - len(dims))


class RawModule:
    def __init__(self, code: str, options: tuple = (), backend: str = "nvrtc", name_expressions=None):
        self._library, self._names = _shared_library(code, tuple(options))

    def get_function(self, name: str) -> Function:
        if name not in self._names:
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name}")
        return Function(self._library, name)


def prebuild(codes_and_options) -> None:
    """Compile several (code, options) in parallel, so the first backend does not wait for them in turn."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda co: _shared_library(*co), codes_and_options))


# ---------------------------------------------------------------------------- cuBLAS

CUDA_R_32F, CUDA_R_16BF = 0, 14
_ELEMENT = {CUDA_R_32F: np.float32, CUDA_R_16BF: np.uint16}
# (A/B type, C type) -> the compute types cuBLAS accepts for it (cublasGemmEx's table, the rows we use)
_SUPPORTED = {(CUDA_R_32F, CUDA_R_32F): {68, 77}, (CUDA_R_16BF, CUDA_R_16BF): {68}, (CUDA_R_16BF, CUDA_R_32F): {68}}


class CUBLASError(RuntimeError):
    pass


def _memory(ptr: int, dtype, count: int) -> np.ndarray:
    # frombuffer, not np.ctypeslib.as_array: that parses the ctypes array's PEP 3118 format on every call, 13 us
    # against 1.5, and a product asks for three of these per matrix of its batch
    return np.frombuffer((ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr), dtype)


def _to_float(x: np.ndarray, kind: int) -> np.ndarray:
    if kind == CUDA_R_16BF:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return np.array(x, np.float32)


def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits), to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def _operand(ptr, kind, op, rows, cols, ld, what, batch=1, stride=0) -> np.ndarray:
    """op(X) for each of `batch` matrices `stride` elements apart, as a (batch, rows, cols) float32 array, X
    stored column-major with leading dimension ld."""
    stored_rows, stored_cols = (rows, cols) if op == 0 else (cols, rows)
    if ld < max(1, stored_rows):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: ld{what} = {ld} < {stored_rows} rows")
    count = (batch - 1) * stride + ld * (stored_cols - 1) + stored_rows
    flat = _memory(ptr, _ELEMENT[kind], count)
    item = flat.itemsize
    x = np.lib.stride_tricks.as_strided(flat, (batch, stored_rows, stored_cols), (stride * item, item, ld * item))
    x = _to_float(x, kind)
    return x if op == 0 else x.swapaxes(1, 2)


def _gemm(transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute,
          bias: np.ndarray | None = None, epilogue=None, batch: int = 1, strides=(0, 0, 0)):
    """C = alpha op(A) op(B) + beta C, column-major, for each of `batch` products whose A, B and C lie `strides`
    elements apart; `bias` (m float32 values, cuBLASLt's bias epilogue) is added to each column of the float32
    product before the one rounding to C's type, and then `epilogue(result, op(A))` (cuBLASLt's other epilogues,
    fake_cublaslt.py; one product only) gives the value rounded. The batch is one stacked numpy matmul, which
    calls BLAS once a matrix as a loop of 2-D products would: the same bits."""
    if Atype != Btype or compute not in _SUPPORTED.get((Atype, Ctype), ()):
        raise CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: A/B type {Atype}, C type {Ctype}, compute {compute}")
    if min(m, n, k) < 0:
        raise CUBLASError("CUBLAS_STATUS_INVALID_VALUE: negative size")
    if m == 0 or n == 0 or batch == 0:
        return
    if ldc < max(1, m):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: ldc = {ldc} < m = {m}")
    if batch > 1 and strides[2] < ldc * (n - 1) + m:  # products that write over each other: in turn, as before
        item = {kind: np.dtype(_ELEMENT[kind]).itemsize for kind in (Atype, Ctype)}
        for i in range(batch):
            _gemm(transa, transb, m, n, k, alpha, A + i * strides[0] * item[Atype], Atype, lda,
                  B + i * strides[1] * item[Btype], Btype, ldb, beta, C + i * strides[2] * item[Ctype], Ctype, ldc,
                  compute)
        return
    a = _operand(A, Atype, transa, m, k, lda, "a", batch, strides[0]) if k else np.zeros((batch, m, 0), np.float32)
    b = _operand(B, Btype, transb, k, n, ldb, "b", batch, strides[1]) if k else np.zeros((batch, 0, n), np.float32)
    if compute == 77:
        a, b = _tf32(a), _tf32(b)
    flat = _memory(C, _ELEMENT[Ctype], (batch - 1) * strides[2] + ldc * (n - 1) + m)
    c = np.lib.stride_tricks.as_strided(flat, (batch, m, n), (strides[2] * flat.itemsize, flat.itemsize,
                                                              ldc * flat.itemsize), writeable=True)
    result = np.float32(alpha) * (a @ b)
    if bias is not None:
        result = result + bias[:, None]
    if epilogue is not None:
        result = epilogue(result[0].astype(np.float32), a[0])[None]
    if beta != 0.0:
        if Ctype == CUDA_R_16BF:  # as cuBLAS 13 does on an H100: the product is rounded to bf16 first
            result = _to_float(_bf16_bits(result.astype(np.float32)), CUDA_R_16BF)
        result = result + np.float32(beta) * _to_float(c, Ctype)
    if Ctype == CUDA_R_16BF:
        c[...] = _bf16_bits(result.astype(np.float32))
    else:
        c[...] = result.astype(np.float32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _extent(ptr, kind, op, rows, cols, ld, batch=1, stride=0) -> tuple[int, int, bool]:
    """The bytes op(X) (rows x cols, column-major, leading dimension ld) covers, over every batch."""
    stored_rows, stored_cols = (rows, cols) if op == 0 else (cols, rows)
    item = np.dtype(_ELEMENT[kind]).itemsize
    return ptr, ptr + ((batch - 1) * stride + ld * (stored_cols - 1) + stored_rows) * item, False


def _gemm_operation(stream, what, transa, transb, m, n, k, A, Atype, lda, B, Btype, ldb, C, Ctype, ldc,
                    batch=1, strides=(0, 0, 0)) -> None:
    """Tell streams.py what a gemm reads and writes, on its handle's stream."""
    if min(m, n, k, batch) <= 0:
        return
    a = _extent(A, Atype, transa, m, k, lda, batch, strides[0])
    b = _extent(B, Btype, transb, k, n, ldb, batch, strides[1])
    c = _extent(C, Ctype, 0, m, n, ldc, batch, strides[2])
    raw_operation(stream, what, [a, b, (c[0], c[1], True)])


def _scalar(ptr: int) -> float:
    return float(_memory(ptr, np.float32, 1)[0])


def _workspace_write(stream, what: str, workspace) -> None:
    if workspace is not None:  # (start, size): a handle's own, written by each of its products
        raw_operation(stream, f"{what} (workspace)", [(workspace[0], workspace[0] + workspace[1], True)])


def gemm_ex(stream, transa, transb, m, n, k, alpha: float, A, Atype, lda, B, Btype, ldb, beta: float, C, Ctype, ldc,
            computeType, workspace=None) -> None:
    """cublasGemmEx queued on `stream` (alpha and beta: host pointer mode, read when queued)."""
    def run():
        _workspace_write(stream, "cublasGemmEx", workspace)
        _gemm_operation(stream, "cublasGemmEx", transa, transb, m, n, k, A, Atype, lda, B, Btype, ldb, C, Ctype, ldc)
        _gemm(transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType)

    _queue(stream, run)


def gemm_strided_batched_ex(stream, transa, transb, m, n, k, alpha: float, A, Atype, lda, strideA, B, Btype, ldb,
                            strideB, beta: float, C, Ctype, ldc, strideC, batchCount, computeType,
                            workspace=None) -> None:
    """cublasGemmStridedBatchedEx queued on `stream`."""
    def run():
        _workspace_write(stream, "cublasGemmStridedBatchedEx", workspace)
        _gemm_operation(stream, "cublasGemmStridedBatchedEx", transa, transb, m, n, k, A, Atype, lda, B, Btype, ldb,
                        C, Ctype, ldc, batchCount, (strideA, strideB, strideC))
        _gemm(transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType,
              batch=batchCount, strides=(strideA, strideB, strideC))

    _queue(stream, run)


def _cublas_module() -> types.ModuleType:
    """CuPy's binding of cuBLAS: each product wrapper first points the handle at the current stream (CuPy's
    _setStream), which is refused while that stream captures."""
    cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T = 0, 1
    cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
    cublas.CUBLAS_GEMM_DEFAULT = -1
    cublas.CUBLAS_POINTER_MODE_HOST, cublas.CUBLAS_POINTER_MODE_DEVICE = 0, 1
    cublas.CUBLASError = CUBLASError

    def create():
        handle = next(_handle_ids)
        _handle_streams[handle] = 0
        return handle

    def destroy(handle):
        del _handle_streams[handle]

    def setStream(handle, stream):
        _set_handle_stream(handle, stream)

    def setPointerMode(handle, mode):
        _handle_streams[handle]  # a KeyError for a destroyed or unknown handle, as cuBLAS's error for one

    def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        _set_handle_stream(handle, get_current_stream().ptr)
        gemm_ex(get_current_stream(), transa, transb, m, n, k, _scalar(alpha), A, Atype, lda, B, Btype, ldb,
                _scalar(beta), C, Ctype, ldc, computeType)

    def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        _set_handle_stream(handle, get_current_stream().ptr)
        gemm_strided_batched_ex(get_current_stream(), transa, transb, m, n, k, _scalar(alpha), A, Atype, lda,
                                strideA, B, Btype, ldb, strideB, _scalar(beta), C, Ctype, ldc, strideC, batchCount,
                                computeType)

    for function in (create, destroy, setStream, setPointerMode, gemmEx, gemmStridedBatchedEx):
        setattr(cublas, function.__name__, function)
    return cublas


# ---------------------------------------------------------------------------- the runtime's copies

def _memset_async(ptr, value, size, stream):
    def run():
        raw_operation(stream, "cudaMemsetAsync", [(ptr, ptr + size, True)])
        ctypes.memset(ptr, value, size)

    _queue(stream, run)


def _memcpy_async(dst, src, size, kind, stream):
    def run():
        raw_operation(stream, "cudaMemcpyAsync", [(src, src + size, False), (dst, dst + size, True)])
        if kind == 2:  # device to host: queued, so the host has seen nothing finish (an event's wait does that)
            host_traffic().append("download_queued")
        ctypes.memmove(dst, src, size)

    _queue(stream, run)


def _alloc_pinned_memory(size):
    """Page-locked host memory: here ordinary memory (np.frombuffer takes it)."""
    return bytearray(size)


# ---------------------------------------------------------------------------- the modules

def install() -> types.ModuleType:
    """Make `import cupy` (and cupy_backends' cuBLAS) give the simulator, in this process (once: a second
    call, say conftest's after site/sitecustomize.py's, returns the module already there)."""
    if getattr(sys.modules.get("cupy"), "cudasim", False):
        return sys.modules["cupy"]
    this = sys.modules[__name__]
    cupy = types.ModuleType("cupy")
    cupy.__doc__ = __doc__
    for name in ("ndarray", "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "asarray", "array",
                 "argsort", "concatenate", "matmul", "RawModule"):
        setattr(cupy, name, getattr(this, name))
    cupy.get_default_memory_pool = lambda: _pool
    cupy.__getattr__ = _numpy_fallback
    cupy.cudasim = True
    cupy.__version__ = "cudasim"

    cuda = types.ModuleType("cupy.cuda")
    runtime = types.SimpleNamespace(
        getDeviceCount=device_count, CUDARuntimeError=CUDARuntimeError, CUDA_R_32F=CUDA_R_32F,
        memsetAsync=_memset_async, memcpyAsync=_memcpy_async, deviceSynchronize=_device_synchronize,
        getDeviceProperties=lambda device: {"name": b"cudasim (CPU)", "totalGlobalMem": 0, "major": 9, "minor": 0,
                                       "multiProcessorCount": 1},
        driverGetVersion=lambda: 0, runtimeGetVersion=lambda: 0, memGetInfo=_mem_get_info)
    cuda.runtime = runtime
    cuda.Device, cuda.Stream, cuda.Event = Device, Stream, Event
    cuda.get_current_stream, cuda.get_elapsed_time = get_current_stream, get_elapsed_time
    cuda.device = types.SimpleNamespace(get_cublas_handle=get_cublas_handle)
    cuda.set_allocator = lambda allocator=None: None
    cuda.alloc_pinned_memory = _alloc_pinned_memory
    cuda.MemoryPool, cuda.using_allocator, cuda.Graph = MemoryPool, using_allocator, Graph
    cupy.cuda = cuda

    backends = types.ModuleType("cupy_backends")
    backends_cuda = types.ModuleType("cupy_backends.cuda")
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = _cublas_module()
    # here, not at the top: fake_cublaslt imports this module's memory and gemm; its install() hooks the
    # import of xtrain_dist's cublaslt, which then finds the stand-in as its loaded library
    import fake_cublas
    import fake_cublaslt
    fake_cublaslt.install()
    fake_cublas.install()
    backends.cuda, backends_cuda.libs = backends_cuda, libs
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy_backends": backends,
                        "cupy_backends.cuda": backends_cuda, "cupy_backends.cuda.libs": libs,
                        "cupy_backends.cuda.libs.cublas": libs.cublas})
    return cupy
