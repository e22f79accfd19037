"""Matrix products through cuBLAS (cublasGemmEx, cublasGemmStridedBatchedEx: cublas.py) and cuBLASLt (a
product with its epilogue, cublaslt.py): the calls, the type tags of their operands, a cuBLAS handle per
stream, and the plans that hand row-major arrays and their transposed views to a column-major library.

The products are methods of CudaBackend (CublasProducts is a mixin of it): they run on the rank's
stream and are checked against it like its kernels, take their types from the backend's precision and
its TF32 choice, and the cuBLASLt handle and workspace they use are the rank's own.

Under --matmul cublaslt the backend reads the GPU's tuning table at start-up (tuned.py, section
"products", written by bin/bench_gemm --search: cublaslt.py says how an entry is kept and checked). Its
entries choose the algorithm of every cuBLASLt product they name, and a product without an epilogue
that the table names (a forward without a bias, an input or weight gradient) runs through cuBLASLt with
that algorithm instead of through cublasGemmEx, which cannot be told one (its algo argument is ignored
since Ampere). No table, or no entry, is today's path: cublasGemmEx, or the heuristic's first.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import cublas, cublaslt, tuned
from .device import cupy, device_name

CUDA_R_16BF = 14  # cudaDataType_t, library_types.h (CUDA_R_32F is 0)


class CublasProducts:
    """CudaBackend's products. The class that mixes it in provides _check_stream (the calling thread's
    stream is the backend's) and calls _init_products from its __init__, on the rank's thread and with the
    rank's device and stream current."""

    def _init_products(self, allow_tf32: bool, matmul: str) -> None:
        # float32 operands: TF32 tensor cores if asked; bf16 operands: always float32 accumulation
        self._compute = {np.dtype(np.float32): cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if allow_tf32
                         else cublas.CUBLAS_COMPUTE_32F, np.dtype(np.uint16): cublas.CUBLAS_COMPUTE_32F}
        self._cuda_type = {np.dtype(np.float32): cupy.cuda.runtime.CUDA_R_32F, np.dtype(np.uint16): CUDA_R_16BF}
        self._cublas: dict[int, cublas.Cublas] = {}  # stream pointer -> that stream's handle (cublas.py)
        # at exit the process's end frees them, perhaps after CUDA's own teardown has begun
        weakref.finalize(self, _destroy_handles, self._cublas).atexit = False
        self._new_cublas_handle(cupy.cuda.get_current_stream())
        self._lt = None
        if matmul == "cublaslt":  # this device's handle and workspace, made on the rank's thread
            self._lt = cublaslt.LtMatmul(cupy, choices=product_choices(device_name(self.device)))

    def _new_cublas_handle(self, stream, workspace_bytes: int = cublas.WORKSPACE_BYTES) -> None:
        """A cuBLAS handle for `stream` (the rank's, or a side thread's), pointed at it once, here, before
        any capture (cublas.py says why not CuPy's)."""
        self._cublas[stream.ptr] = cublas.Cublas(cupy, stream.ptr, workspace_bytes)

    def _handle(self) -> cublas.Cublas:
        """The handle of the calling thread's stream (_check_stream has checked it is one of this backend's)."""
        return self._cublas[cupy.cuda.get_current_stream().ptr]

    def _types(self, a, b, out) -> tuple[int, int, int]:
        """(operand type, output type, compute type) for a product of a and b into out: the operands share
        a dtype (float32, or bf16 bits); the output is float32 or that dtype; alpha and beta are float32."""
        if a.dtype != b.dtype or out.dtype not in (a.dtype, np.float32):
            raise TypeError(f"cuda_ops gemm: {a.dtype} @ {b.dtype} -> {out.dtype} is not a supported product")
        return self._cuda_type[a.dtype], self._cuda_type[out.dtype], self._compute[a.dtype]

    def _gemm(self, a, b, out, alpha: float = 1.0, beta: float = 0.0) -> None:
        """out = alpha * a @ b + beta * out, for 2-D arrays each either row-major (C-contiguous) or the
        transpose of a row-major array (F-contiguous, like numpy's `.T` views); see _gemm_plan."""
        self._check_stream()
        if beta != 0.0 and out.dtype != np.float32:  # see matmul.cu
            raise TypeError(f"cuda_ops gemm: beta = {beta} into a bf16 output would round twice: cuBLAS rounds "
                            "the product to bf16 before it adds C")
        first, second, op1, op2, rows, cols, k, ld1, ld2, ldc = _gemm_plan(a, b, out)
        ab_type, c_type, compute = self._types(a, b, out)
        if (self._lt is not None and alpha == 1.0 and beta in (0.0, 1.0) and min(rows, cols, k) > 1
                and self._lt.takes(op1, op2, rows, cols, k, ab_type, ld1, ld2, c_type, ldc, compute)):
            # the tuning table's algorithm (gemm.py's docstring); cuBLASLt's heuristic refuses an A of one row
            self._lt.matmul(op1, op2, rows, cols, k, first.data.ptr, ab_type, ld1, second.data.ptr, ld2,
                            out.data.ptr, c_type, ldc, compute, cupy.cuda.get_current_stream().ptr,
                            accumulate=beta == 1.0, keep=(first, second, out))
            return
        self._handle().gemm(op1, op2, rows, cols, k, alpha, first.data.ptr, ab_type, ld1, second.data.ptr, ab_type,
                            ld2, beta, out.data.ptr, c_type, ldc, compute)

    def _gemm_bias(self, a, b, bias, out) -> None:
        """out = a @ b + bias (bias broadcast over rows), rounded once to out's type: cuBLASLt's bias
        epilogue. out is row-major, so cuBLAS computes out^T = b^T a^T, whose rows are bias's elements."""
        self._gemm_lt(a, b, out, cublaslt.CUBLASLT_EPILOGUE_BIAS, bias=bias)

    def _gemm_lt(self, a, b, out, epilogue: int, bias=None, aux=None, accumulate: bool = False) -> None:
        """out = epilogue(a @ b [+ out if accumulate]) through cuBLASLt, for a row-major out (cublaslt.LtMatmul
        says what each epilogue does). In cuBLAS's terms the product is out^T = b^T a^T, so D's rows are out's
        columns: a bias, or the bias gradient written into `bias`, has out.shape[1] elements; the GELU aux
        matrix is row-major like out and of its shape and type (GELU_AUX_BIAS writes it, DGELU reads it)."""
        self._check_stream()
        first, second, op1, op2, rows, cols, k, ld1, ld2, ldc = _gemm_plan(a, b, out)
        if _matrix_layout(out, "output")[0] != "C":
            raise ValueError(f"cuda_ops gemm: an epilogue needs a row-major output, got strides {out.strides}")
        bias_ptr, bias_type, aux_ptr, ld_aux = 0, -1, 0, 0
        if bias is not None:
            if bias.shape != (rows,) or not bias.flags.c_contiguous:
                raise ValueError(f"cuda_ops gemm: a bias {bias.shape} for an output {out.shape} with strides "
                                 f"{out.strides}")
            bias_ptr, bias_type = bias.data.ptr, self._cuda_type[bias.dtype]
        if aux is not None:
            order, ld_aux = _matrix_layout(aux, "aux")
            if order != "C" or aux.shape != out.shape or aux.dtype != out.dtype or ld_aux % cublaslt.AUX_LD_MULTIPLE:
                raise ValueError(f"cuda_ops gemm: a GELU aux {aux.shape} {aux.dtype} strides {aux.strides} for an "
                                 f"output {out.shape} {out.dtype}")
            aux_ptr = aux.data.ptr
        ab_type, c_type, compute = self._types(a, b, out)
        self._lt.matmul(op1, op2, rows, cols, k, first.data.ptr, ab_type, ld1, second.data.ptr, ld2,
                        out.data.ptr, c_type, ldc, compute, cupy.cuda.get_current_stream().ptr, epilogue,
                        bias=bias_ptr, bias_type=bias_type, aux=aux_ptr, ld_aux=ld_aux, accumulate=accumulate,
                        keep=(first, second, out, bias, aux))

    def _gemm_batched(self, a, b, out, trans_a: bool = False, trans_b: bool = False, alpha: float = 1.0) -> None:
        """out[i] = alpha * op(a[i]) @ op(b[i]) for (batch, rows, cols) arrays with contiguous rows (C-contiguous,
        or slices of such along the last two axes: _batched_layout), op = transpose where asked. Column-major:
        out[i]^T = op(b[i])^T op(a[i])^T, and a row-major X with row stride ld is X^T with leading dimension ld."""
        self._check_stream()
        batch, m, n = out.shape
        k = a.shape[1] if trans_a else a.shape[2]
        (ld_a, stride_a), (ld_b, stride_b), (ld_out, stride_out) = (_batched_layout(x) for x in (a, b, out))
        op_b = cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N
        op_a = cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N
        ab_type, c_type, compute = self._types(a, b, out)
        self._handle().gemm_strided_batched(op_b, op_a, n, m, k, alpha, b.data.ptr, ab_type, ld_b, stride_b,
                                            a.data.ptr, ab_type, ld_a, stride_a, 0.0, out.data.ptr, c_type, ld_out,
                                            stride_out, batch, compute)


# ---------------------------------------------------------------------------- handles and operand layouts

def product_choices(gpu: str, folder=None) -> dict[str, tuple[int, ...]]:
    """This GPU model's measured product algorithms ({product_key: 8 words}; {} where none were measured);
    a table that cannot be read, or an entry without an algorithm, is one line naming the file."""
    return cublaslt.check_choices(tuned.load_section(gpu, "products", folder), str(tuned.table_path(gpu, folder)))


def _destroy_handles(handles: dict) -> None:
    """The backend's cuBLAS handles, once it is gone."""
    for handle in handles.values():
        handle.destroy()
    handles.clear()


def _gemm_plan(a, b, out):
    """The cublasGemmEx arguments for out = a @ b: (first, second, op1, op2, rows, cols, k, ld1, ld2, ldc).

    cuBLAS is column-major. A row-major X (rows ld elements apart: C-contiguous, ld = X.shape[1], or
    the first columns of a wider array, like the classifier's padded logits) sits in memory as the
    column-major X^T with leading dimension ld; the transpose of such an array (an F-ordered `.T` view)
    as X itself. For a row-major out we ask cuBLAS for out^T = b^T a^T, for an F-ordered out (dwte.T)
    for out = a b; each operand then needs a transpose or not depending on which of the two ways it is
    stored. Pure: takes anything with .shape, .strides and .itemsize.

    The layouts decide the ops, not the order: with Conv1D's weights (in, out), a forward is "NN", its
    input gradient "TN" and its weight gradient "NT", where PyTorch's nn.Linear (out, in) has "TN", "NN"
    and "NT". Putting the other operand first would need a column-major output, which the next op cannot
    read; bin/bench_gemm's "product tn" rows time our product with the weight stored (out, in), to say
    whether the layout is worth changing for the shapes where cuBLAS is slower on NN."""
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"cuda_ops gemm: {a.shape} @ {b.shape} -> {out.shape}")
    order, ldc = _matrix_layout(out, "output")
    if order == "C":
        first, second, rows, cols, transposed = b, a, n, m, True
    else:
        first, second, rows, cols, transposed = a, b, m, n, False
    op1, ld1 = _cublas_operand(first, transposed)
    op2, ld2 = _cublas_operand(second, transposed)
    return first, second, op1, op2, rows, cols, k, ld1, ld2, ldc


def _matrix_layout(x, what: str = "operand") -> tuple[str, int]:
    """("C", ld) for a 2-D x whose rows are ld elements apart, each contiguous; ("F", ld) for one whose
    columns are. ld is at least the row's (column's) length and 1; a size-1 dimension's stride does not
    matter (CuPy may set it to anything)."""
    rows, cols = x.shape
    item = x.itemsize
    row_step, col_step = x.strides
    if (col_step == item or cols <= 1) and row_step % item == 0 and (rows <= 1 or row_step >= cols * item):
        return "C", max(row_step // item if rows > 1 else cols, 1)
    if (row_step == item or rows <= 1) and col_step % item == 0 and (cols <= 1 or col_step >= rows * item):
        return "F", max(col_step // item if cols > 1 else rows, 1)
    raise ValueError(f"cuda_ops gemm: {what} strides {x.strides} are neither C nor F order")


def _cublas_operand(x, transposed: bool) -> tuple[int, int]:
    """(op, ld) that make cuBLAS read x (transposed=False) or x^T (transposed=True) from x's memory."""
    order, ld = _matrix_layout(x)
    if order == "C":  # memory holds x^T column-major
        return (cublas.CUBLAS_OP_N if transposed else cublas.CUBLAS_OP_T), ld
    return (cublas.CUBLAS_OP_T if transposed else cublas.CUBLAS_OP_N), ld  # memory holds x column-major


def _batched_layout(x) -> tuple[int, int]:
    """(row stride, matrix stride) in elements of a (batch, rows, cols) array whose rows are contiguous: a
    C-contiguous array or a slice of one along its last two axes (a chunk of causal attention's T x T)."""
    item = x.itemsize
    row, matrix = x.strides[1], x.strides[0]
    if x.strides[2] != item or row % item or matrix % item or row < x.shape[2] * item:
        raise ValueError(f"cuda_ops batched gemm: expected contiguous rows, got shape {x.shape} strides {x.strides}")
    return row // item, matrix // item
