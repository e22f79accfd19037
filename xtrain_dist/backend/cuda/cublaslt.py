"""cuBLASLt through ctypes, for what cublasGemmEx cannot do: work in the product's epilogue, on the float32
accumulator, before the output's one rounding.

A linear layer's forward is out = inp @ weight + bias. cublasGemmEx can only add a bias it finds in C
(beta = 1), and with a bf16 output it rounds the product to bf16 before adding C, so the result is
rounded twice (kernels/matmul.cu). The default path therefore writes a float32 product and adds the
bias in a kernel of its own, which costs a float32 write and read of the whole output. cuBLASLt's bias
epilogue adds the bias to the float32 accumulator inside the product and rounds once: the same value
the numpy oracle computes (numpy_ops.matmul_forward), with neither the extra pass nor the float32 buffer.
llm.c does the same (llmc/matmul.cuh). `--matmul cublaslt` asks for it, and for the other epilogues the
backend uses (cuda/ops.py): GELU after c_fc's bias, keeping the pre-GELU sum for backward
(GELU_AUX_BIAS), GELU's derivative on c_proj's input gradient (DGELU), and each layer's bias gradient
computed by its weight-gradient product (BGRADA), each of which takes a whole pass over an activation
away.

CuPy does not expose cuBLASLt, so this module binds the functions it needs with ctypes. Each
`LtMatmul` (one per backend, so per rank) owns a handle and a workspace, and keeps one plan per shape
and epilogue: the operation and layout descriptors and the algorithm cuBLASLt's heuristic picks for
them, asked once. The enum values, attribute types, struct layout and function prototypes below are
cublasLt.h's; tests/test_cublaslt.py checks them against the header (compiled, and read as text) and
the library where it finds them.

The binding: ctypes or nvmath-python. NVIDIA's nvmath-python (`nvmath.bindings.cublasLt`, 1.0.0) binds
the same C functions with typed enums (create, matmul_desc_create, matmul_desc_set_attribute,
matmul_algo_get_heuristic, matmul, each taking the same handles and device addresses as integers), so it
would replace the hand-copied enums and structs here. `pip download nvmath-python` fetches a 5.5 MB wheel
(cp311, manylinux_2_28), which needs cuda-bindings, cuda-core and cuda-pathfinder besides the cuBLAS
wheel this module already loads; on 2026-11-26 it imported beside cuda-bindings 13.5.0 and cuda-core 1.2.2
(on a machine without a GPU, where its first call stops at the missing driver), and its matmul and
matmul_desc_set_attribute take the arguments this module passes, in the same order, as integers.
The criterion: a step makes about 100 cuBLASLt calls (GPT-2 124M: 12 layers x 9 products with an
epilogue), each paying the binding's host cost on the critical path of a launch-bound step; nvmath is
worth the dependency where its per-call cost is no more than ctypes' (a few microseconds each, so at most
~0.5 ms a step either way) and it loads beside CuPy's cuBLAS without a second copy of the library.
bin/bench_gemm --lt-bindings times both on a GPU (the call alone, plans cached, the product 64 x 64 x 64
so that the GPU keeps up); until that is measured, ctypes stays: it needs
no dependency, and the header tests keep its copies honest.

Algorithms by measured choice. The heuristic ranks algorithms by an estimate; the first is not always
the fastest (an H200 ran attn.c_proj's 8192 x 768 x 768 bf16 forward at 0.65x PyTorch's, 2026-11-26).
`bin/bench_gemm --search` asks the heuristic for its top SEARCH_COUNT algorithms for every product the
step runs, times each, and keeps the fastest in the GPU's tuning table (tuned.py, section "products"),
one entry per `product_key`: the operand ops, sizes, types, leading dimensions, compute type and
epilogue, which is everything the heuristic is asked with except the pointers' alignment. An LtMatmul
given those entries (`choices`) asks the heuristic for SEARCH_COUNT algorithms wherever it has an entry,
and runs the one whose cublasLtMatmulAlgo_t words equal the entry's; with no entry it asks for one, as
before. An entry is stored as the algorithm's 8 words and is used only where the heuristic offers those
same words for the very plan being made, so it survives a cuBLAS or driver update safely: the words are
opaque and their meaning may change between versions, and a rank alone would silently name whatever
the new version ranks there; checked against what the running library offers, an entry from another
version (or another alignment of the operands) is simply not found, and the product takes the
heuristic's first, counted in `choices_missed`. (cublasLtMatmulAlgoCheck would accept words the
heuristic never offered for this plan; being offered is the stronger check.)
"""

from __future__ import annotations

import ctypes
import threading

from ...errors import XtrainError

# cublasLt.h (CUDA 13) values; tests/test_cublaslt.py compiles them against the header
CUBLAS_STATUS_SUCCESS = 0
STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}
CUBLASLT_MATMUL_DESC_TRANSA = 3          # int32_t (cublasOperation_t)
CUBLASLT_MATMUL_DESC_TRANSB = 4          # int32_t
CUBLASLT_MATMUL_DESC_EPILOGUE = 7        # uint32_t (cublasLtEpilogue_t)
CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8    # const void* (the bias), or void* (the bias gradient it writes)
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11  # void* (GELU_AUX_BIAS writes the pre-GELU matrix; DGELU reads it)
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12       # int64_t, in elements; a multiple of 8 for GELU's
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22  # int32_t (cudaDataType)
CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26  # int32_t (cudaDataType)
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1    # uint64_t
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5  # uint32_t, then B, C, D at 6, 7, 8
CUDA_R_32F = 0  # library_types.h: cudaDataType, as the scale (alpha, beta) type

# cublasLtEpilogue_t: what the product does to its float32 accumulator before D's one rounding
CUBLASLT_EPILOGUE_DEFAULT = 1         # nothing
CUBLASLT_EPILOGUE_BIAS = 4            # + bias (D's rows long), broadcast along D's columns
CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 164  # aux = + bias; D = gelu(+ bias) (tanh approximation)
CUBLASLT_EPILOGUE_DGELU = 192         # D = product * gelu'(aux)
CUBLASLT_EPILOGUE_BGRADA = 256        # bias gradient = sum of op(A) over k (D's rows long), written to the bias pointer
# the epilogues' names in a tuning table's keys (cublasLt.h's, without the prefix)
EPILOGUE_KEYS = {CUBLASLT_EPILOGUE_DEFAULT: "DEFAULT", CUBLASLT_EPILOGUE_BIAS: "BIAS",
                 CUBLASLT_EPILOGUE_GELU_AUX_BIAS: "GELU_AUX_BIAS", CUBLASLT_EPILOGUE_DGELU: "DGELU",
                 CUBLASLT_EPILOGUE_BGRADA: "BGRADA"}
EPILOGUE_NAMES = {CUBLASLT_EPILOGUE_DEFAULT: "no", CUBLASLT_EPILOGUE_BIAS: "a bias",
                  CUBLASLT_EPILOGUE_GELU_AUX_BIAS: "a bias + GELU", CUBLASLT_EPILOGUE_DGELU: "a GELU-gradient",
                  CUBLASLT_EPILOGUE_BGRADA: "a bias-gradient"}
# the epilogues that read or write the bias pointer, and those that read or write the aux matrix
BIAS_EPILOGUES = (CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_EPILOGUE_BGRADA)
AUX_EPILOGUES = (CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_EPILOGUE_DGELU)
AUX_LD_MULTIPLE = 8  # cublasLt.h: a GELU aux matrix's leading dimension "must be divisible by 8"

# The attributes this module sets, with the C type cublasLt.h gives each: the library checks the size.
DESC_ATTRIBUTE_TYPES = {CUBLASLT_MATMUL_DESC_TRANSA: ctypes.c_int32, CUBLASLT_MATMUL_DESC_TRANSB: ctypes.c_int32,
                        CUBLASLT_MATMUL_DESC_EPILOGUE: ctypes.c_uint32,
                        CUBLASLT_MATMUL_DESC_BIAS_POINTER: ctypes.c_void_p,
                        CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: ctypes.c_void_p,
                        CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: ctypes.c_int64,
                        CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: ctypes.c_int32,
                        CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: ctypes.c_int32}
PREF_ATTRIBUTE_TYPES = {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: ctypes.c_uint64,
                        **{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i: ctypes.c_uint32 for i in range(4)}}

# As llm.c: Hopper's fastest kernels want up to 32 MiB (split-K and stream-K partial sums)
WORKSPACE_BYTES = 32 << 20
MAX_ALIGNMENT = 256  # the alignment the heuristic assumes unless told less (cublasLt.h: MIN_ALIGNMENT_*)
# how many of the heuristic's algorithms bin/bench_gemm --search times per product, and a tuned plan asks for
SEARCH_COUNT = 8
# cudaDataType values (library_types.h) as a key spells them; cublasComputeType_t likewise (cublas_api.h)
TYPE_KEYS = {0: "f32", 14: "bf16"}
COMPUTE_KEYS = {68: "32F", 77: "32F_FAST_TF32"}


class MatmulAlgo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t: opaque


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # cublasLtMatmulHeuristicResult_t


_P = ctypes.c_void_p
_SIGNATURES = {  # name: argtypes (every function but the first returns cublasStatus_t)
    "cublasLtGetVersion": [],  # returns size_t
    "cublasLtCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulDescGetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulPreferenceSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.POINTER(HeuristicResult),
                                       ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(MatmulAlgo), _P,
                       ctypes.c_size_t, _P],
}

_library = None
_library_lock = threading.Lock()


def load_library(path: str | None = None):
    """libcublasLt as a ctypes library with its functions' argument types set: from `path`, else where
    cuda.pathfinder finds NVIDIA's wheel (what CuPy's own cuBLAS loads), else by soname. Loaded once."""
    global _library
    with _library_lock:
        if _library is not None and path is None:
            return _library
        library = ctypes.CDLL(path) if path else find_library()
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_size_t if name == "cublasLtGetVersion" else ctypes.c_int
        if path is None:
            _library = library
        return library


def describe_library() -> str:
    """Which libcublasLt a run loads, and its version (cublasLtGetVersion: major * 10000 + minor * 100 +
    patch), for a results folder's record of what ran."""
    library = load_library()
    return f"{library._name}, version {library.cublasLtGetVersion()}"


def find_library(name: str = "cublasLt", option: str = "--matmul cublaslt"):
    """lib<name> (cublasLt, or cublas for cublas.py) as a ctypes library: where cuda.pathfinder finds NVIDIA's
    wheel, else by soname; XtrainError naming `option` and everything tried where neither loads."""
    tried = []
    try:
        from cuda import pathfinder
        return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib(name).abs_path)
    except Exception as e:  # not installed, or no wheel: try the loader's search path
        tried.append(f"cuda.pathfinder: {e}")
    for soname in (f"lib{name}.so.13", f"lib{name}.so"):
        try:
            return ctypes.CDLL(soname)
        except OSError as e:
            tried.append(str(e))
    raise XtrainError(f"{option}: cannot load lib{name} (" + "; ".join(tried) +
                      "): pip install nvidia-cublas, the wheel CuPy's cuBLAS comes from")


def check(library, function: str, *args) -> None:
    status = getattr(library, function)(*args)
    if status != CUBLAS_STATUS_SUCCESS:
        raise XtrainError(f"cuBLASLt: {function} failed: {STATUS_NAMES.get(status, f'status {status}')}")


def set_attribute(library, function: str, descriptor, attribute: int, value) -> None:
    """Set one attribute of a descriptor (function: cublasLtMatmulDescSetAttribute or
    cublasLtMatmulPreferenceSetAttribute) to `value`, passed as the C type cublasLt.h gives it."""
    types = DESC_ATTRIBUTE_TYPES if function == "cublasLtMatmulDescSetAttribute" else PREF_ATTRIBUTE_TYPES
    held = types[attribute](value)
    check(library, function, descriptor, attribute, ctypes.byref(held), ctypes.sizeof(held))


def alignment(pointer: int) -> int:
    """The largest power of two (up to 256 bytes) that divides a device address."""
    return min(pointer & -pointer, MAX_ALIGNMENT) if pointer else MAX_ALIGNMENT


def product_key(op_a: int, op_b: int, rows: int, cols: int, k: int, a_type: int, ld_a: int, ld_b: int, d_type: int,
                ld_d: int, bias_type: int, compute: int, epilogue: int, ld_aux: int) -> str:
    """A product's entry name in a tuning table: what the heuristic is asked with but the alignment, in
    cuBLAS's column-major terms, e.g. 'NN 2304x8192x768 bf16>bf16 ld 2304,768,2304 compute 32F BIAS bf16'
    (rows x cols x k; a bias's type, an aux matrix's leading dimension where the epilogue has them)."""
    types = f"{TYPE_KEYS.get(a_type, a_type)}>{TYPE_KEYS.get(d_type, d_type)}"
    key = (f"{'NT'[op_a]}{'NT'[op_b]} {rows}x{cols}x{k} {types} "
           f"ld {ld_a},{ld_b},{ld_d} compute {COMPUTE_KEYS.get(compute, compute)} {EPILOGUE_KEYS[epilogue]}")
    if epilogue in BIAS_EPILOGUES:
        key += f" {TYPE_KEYS.get(bias_type, bias_type)}"
    if epilogue in AUX_EPILOGUES:
        key += f" aux ld {ld_aux}"
    return key


def algo_words(algo: MatmulAlgo) -> list[str]:
    """An algorithm's 8 words as a table keeps them (hexadecimal strings: JSON readers need not hold 64 bits)."""
    return [f"{word:#x}" for word in algo.data]


def check_choices(choices: dict, where: str) -> dict[str, tuple[int, ...]]:
    """A tuning table's "products" section as {product_key: the algorithm's 8 words}; an entry without 8
    hexadecimal words is one line naming it (`where`: the table), never a silent default."""
    checked = {}
    for key, entry in choices.items():
        words = entry.get("algo") if isinstance(entry, dict) else None
        try:
            if not isinstance(words, list) or len(words) != 8:
                raise ValueError
            checked[key] = tuple(int(word, 16) for word in words)
        except (TypeError, ValueError):
            raise XtrainError(f"tuning table '{where}': product {key!r} has no algorithm of 8 hexadecimal words "
                              f"(got {words!r})") from None
    return checked


class LtMatmul:
    """D = epilogue(op(A) op(B) + beta D) on a stream, in cuBLAS's column-major terms: A is rows x k after op,
    B k x cols, D rows x cols, each with a leading dimension. The epilogue (EPILOGUE_NAMES) acts on the
    float32 accumulator before D's one rounding: + bias (`rows` elements, broadcast along D's columns), that
    then GELU with the pre-GELU sum written to `aux`, times GELU's derivative at `aux`, or the bias gradient
    (the sum of op(A) over k, `rows` elements) written to `bias`. Made on the rank's thread, with the rank's
    device current: the handle and workspace belong to that device.

    choices: {product_key: the algorithm's 8 words} (check_choices), the measured fastest of each product
    (the module's docstring). `record()` makes it keep every product it runs from then on, with its
    operands, for bin/bench_gemm --search to time the heuristic's candidates on (gemm_search.py)."""

    def __init__(self, cupy, library=None, workspace_bytes: int = WORKSPACE_BYTES, choices: dict | None = None):
        self._lib = library if library is not None else load_library()
        self._handle = _P()
        check(self._lib, "cublasLtCreate", ctypes.byref(self._handle))
        self._workspace = cupy.empty((workspace_bytes,), dtype=cupy.uint8)  # 256-byte aligned (CuPy's pool)
        self._workspace_bytes = workspace_bytes
        self._plans: dict[tuple, tuple] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.choices = dict(choices or {})
        # the product keys whose plan found its table entry among the heuristic's algorithms, and those that
        # did not (a table of another cuBLAS version, or operands less aligned than when it was measured)
        self.choices_used: set[str] = set()
        self.choices_missed: set[str] = set()
        self.recorded: dict[tuple, tuple] | None = None  # plan key -> the last call's operands, while recording
        self._kept: dict[tuple, tuple] = {}  # plan key -> the arrays behind those operands (matmul's keep)

    def record(self) -> None:
        """From now on keep each product's plan key and operands (the last call's), for the search; what an
        earlier record() kept is let go."""
        self.recorded, self._kept = {}, {}

    def stop_recording(self) -> None:
        self.recorded, self._kept = None, {}

    def takes(self, op_a: int, op_b: int, rows: int, cols: int, k: int, a_type: int, ld_a: int, ld_b: int,
              d_type: int, ld_d: int, compute: int) -> bool:
        """Whether a product without an epilogue should run here rather than through cublasGemmEx: where the
        table has measured an algorithm for it, or while recording (so that the search sees it)."""
        return self.recorded is not None or product_key(op_a, op_b, rows, cols, k, a_type, ld_a, ld_b, d_type, ld_d,
                                                        -1, compute, CUBLASLT_EPILOGUE_DEFAULT, 0) in self.choices

    def matmul_bias(self, op_a: int, op_b: int, rows: int, cols: int, k: int,
                    a: int, a_type: int, ld_a: int, b: int, ld_b: int,
                    d: int, d_type: int, ld_d: int, bias: int, bias_type: int, compute: int, stream: int) -> None:
        """Enqueue D = op(A) op(B) + bias on `stream` (pointers are device addresses, A and B share a_type)."""
        self.matmul(op_a, op_b, rows, cols, k, a, a_type, ld_a, b, ld_b, d, d_type, ld_d, compute, stream,
                    CUBLASLT_EPILOGUE_BIAS, bias=bias, bias_type=bias_type)

    def matmul(self, op_a: int, op_b: int, rows: int, cols: int, k: int, a: int, a_type: int, ld_a: int,
               b: int, ld_b: int, d: int, d_type: int, ld_d: int, compute: int, stream: int,
               epilogue: int = CUBLASLT_EPILOGUE_DEFAULT, bias: int = 0, bias_type: int = -1, aux: int = 0,
               ld_aux: int = 0, accumulate: bool = False, keep: tuple = ()) -> None:
        """Enqueue D = epilogue(op(A) op(B) [+ D if accumulate]) on `stream` (device addresses; A and B share
        a_type; the aux matrix, where the epilogue has one, has D's type and rows and ld_aux). keep: the
        arrays behind the pointers, held while recording so that the search's reruns write into live memory
        (an output or a scratch vector the caller has dropped would otherwise be freed, or reused)."""
        # C is D (beta = 0 never reads it). The preferences have no entry for the bias or the aux matrix, and
        # an algorithm's vector loads may need them as aligned as D: D's entry is the smallest of the
        # alignments, so that the algorithm chosen suits them too (PyTorch's addmm tells the heuristic the
        # bias's alignment in that same entry). The biases are views into the flat parameters, at any offset.
        d_aligned = min(alignment(d), alignment(bias) if bias else MAX_ALIGNMENT,
                        alignment(aux) if aux else MAX_ALIGNMENT)
        aligned = (alignment(a), alignment(b), d_aligned, d_aligned)
        # beta is an argument of the call, not of the descriptors: the plan serves both
        key = (op_a, op_b, rows, cols, k, a_type, ld_a, ld_b, d_type, ld_d, bias_type, compute, epilogue, ld_aux,
               aligned)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(key, bias, aux)
        operands = (a, b, d, bias, aux, accumulate, stream)
        if self.recorded is not None:
            self.recorded[key] = operands
            self._kept[key] = keep
        self._run(plan, operands, plan[4])

    def _run(self, plan: tuple, operands: tuple, algo: MatmulAlgo) -> None:
        desc, layout_a, layout_b, layout_d = plan[:4]
        a, b, d, bias, aux, accumulate, stream = operands
        epilogue = plan[5]
        # the bias and aux pointers change from call to call (each layer's own); the plan was made for their
        # alignment
        if epilogue in BIAS_EPILOGUES:
            set_attribute(self._lib, "cublasLtMatmulDescSetAttribute", desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias)
        if epilogue in AUX_EPILOGUES:
            set_attribute(self._lib, "cublasLtMatmulDescSetAttribute", desc,
                          CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)
        beta = self._one if accumulate else self._zero
        check(self._lib, "cublasLtMatmul", self._handle, desc, ctypes.byref(self._one), a, layout_a, b, layout_b,
              ctypes.byref(beta), d, layout_d, d, layout_d, ctypes.byref(algo), self._workspace.data.ptr,
              self._workspace_bytes, stream)

    def candidates(self, key: tuple) -> list[MatmulAlgo]:
        """The heuristic's algorithms for a recorded product, best-estimated first (up to SEARCH_COUNT)."""
        return self._plans[key][6]

    def run_with(self, key: tuple, algo: MatmulAlgo) -> None:
        """The recorded product `key` again, on its recorded operands and stream, with `algo`."""
        self._run(self._plans[key], self.recorded[key], algo)

    def _plan(self, key: tuple, bias: int, aux: int) -> tuple:
        """The descriptors for one shape, epilogue and alignment, and the algorithm to run: the table's where
        the heuristic offers it, else the heuristic's first. Returns (desc, layouts A, B, D, the algorithm, the
        epilogue, the heuristic's algorithms)."""
        op_a, op_b, rows, cols, k, a_type, ld_a, ld_b, d_type, ld_d, bias_type, compute, epilogue, ld_aux, aligned = key
        lib = self._lib
        desc = _P()
        check(lib, "cublasLtMatmulDescCreate", ctypes.byref(desc), compute, CUDA_R_32F)
        attributes = [(CUBLASLT_MATMUL_DESC_TRANSA, op_a), (CUBLASLT_MATMUL_DESC_TRANSB, op_b),
                      (CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue)]
        if epilogue in BIAS_EPILOGUES:
            attributes += [(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type), (CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias)]
        if epilogue in AUX_EPILOGUES:
            attributes += [(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, d_type),
                           (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld_aux),
                           (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)]
        for attribute, value in attributes:
            set_attribute(lib, "cublasLtMatmulDescSetAttribute", desc, attribute, value)
        layouts = []
        # stored shapes: A is rows x k, or k x rows when transposed; B is k x cols, or cols x k
        for kind, stored_rows, stored_cols, ld in ((a_type, *((rows, k) if op_a == 0 else (k, rows)), ld_a),
                                                   (a_type, *((k, cols) if op_b == 0 else (cols, k)), ld_b),
                                                   (d_type, rows, cols, ld_d)):
            layout = _P()
            check(lib, "cublasLtMatrixLayoutCreate", ctypes.byref(layout), kind, stored_rows, stored_cols, ld)
            layouts.append(layout)
        preference = _P()
        check(lib, "cublasLtMatmulPreferenceCreate", ctypes.byref(preference))
        set_attribute(lib, "cublasLtMatmulPreferenceSetAttribute", preference,
                      CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, self._workspace_bytes)
        for i, value in enumerate(aligned):  # A, B, C, D
            set_attribute(lib, "cublasLtMatmulPreferenceSetAttribute", preference,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i, value)
        name = product_key(*key[:-1])
        chosen = self.choices.get(name)
        # one algorithm unless there is a choice to find among them, or a search to come
        count = SEARCH_COUNT if chosen is not None or self.recorded is not None else 1
        results, found = (HeuristicResult * count)(), ctypes.c_int(0)
        layout_a, layout_b, layout_d = layouts
        check(lib, "cublasLtMatmulAlgoGetHeuristic", self._handle, desc, layout_a, layout_b, layout_d, layout_d,
              preference, count, results, ctypes.byref(found))
        offered = [r.algo for r in results[:found.value] if r.state == CUBLAS_STATUS_SUCCESS]
        if not offered:
            raise XtrainError(f"cuBLASLt has no algorithm for a {rows} x {k} x {cols} product with "
                              f"{EPILOGUE_NAMES[epilogue]} epilogue (types {a_type} -> {d_type}, compute {compute}); "
                              "run without --matmul cublaslt")
        algo = offered[0]
        if chosen is not None:
            match = [a for a in offered if tuple(a.data) == chosen]
            (self.choices_used if match else self.choices_missed).add(name)
            algo = match[0] if match else algo
        return desc, layout_a, layout_b, layout_d, algo, epilogue, offered


def search(lt: LtMatmul, time_call, done: set[str] = frozenset()) -> tuple[dict, dict]:
    """Time the heuristic's algorithms for every product `lt` has recorded since record() (their operands
    still alive), each run on its recorded operands: time_call(call) -> ms of call() (a mean over repeats,
    bin/bench_gemm's). Returns (entries, failures), both by product_key: entries as the tuning table keeps
    them (the fastest algorithm's words, its heuristic rank, its ms and the heuristic first's); a product
    whose search failed is in failures with why, and the next product is searched all the same. An
    algorithm the library offers but refuses to run is passed over; keys in `done` are not searched again."""
    entries, failures = {}, {}
    for key in list(lt.recorded or {}):
        name = product_key(*key[:-1])
        if name in done or name in entries or name in failures:
            continue
        try:
            timed, refused = [], []
            for rank, algo in enumerate(lt.candidates(key)):
                try:
                    timed.append((time_call(lambda key=key, algo=algo: lt.run_with(key, algo)), rank, algo))
                except XtrainError as e:
                    refused.append(f"rank {rank}: {e}")
            if not timed:
                raise XtrainError("no algorithm of the heuristic's ran (" + "; ".join(refused) + ")")
            ms, rank, algo = min(timed, key=lambda t: (t[0], t[1]))  # a tie goes to the heuristic's order
            first = [t[0] for t in timed if t[1] == 0]
            entries[name] = {"algo": algo_words(algo), "rank": rank, "ms": ms,
                             "first_ms": first[0] if first else None, "tried": len(timed)}
        except Exception as e:  # fail-soft: this product keeps the heuristic's first, the search goes on
            failures[name] = f"{type(e).__name__}: {e}"
    return entries, failures
