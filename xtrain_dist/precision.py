"""Training precision (`--dtype`, and the products' `--tf32` and `--matmul`): what is stored in bfloat16.

fp32: everything float32 (matmuls may still use TF32 tensor cores with --tf32).
bf16: mixed precision as llm.c does it. Activations, and a copy of the parameters that forward and
      backward read (`GPT2.params_lowp`), are bfloat16; matmuls take bfloat16 inputs on tensor cores
      and accumulate in float32. Parameter gradients, the float32 master parameters, AdamW's m and v,
      layernorm statistics, attention scores, losses and every reduction stay float32.

bfloat16 is float32's upper 16 bits: the same 8-bit exponent (so the same range: no loss scaling is
needed, unlike float16) with 7 mantissa bits instead of 23, i.e. 2-3 significant decimal digits
(unit roundoff 2^-8 ~ 0.4%). The CUDA backend stores it as real 16-bit values (uint16 arrays holding
the bits, see docs/cuda_backend.md); the numpy backend emulates it in float32 storage by rounding every value
the GPU would store in bfloat16 (numpy_ops.NumpyBackend.store). numpy_ops also converts between the
two on the host (bf16_bits, from_bf16_bits), beside the rounding that is their oracle.
"""

import numpy as np

from .command import must_be, one_of
from .errors import XtrainError

DTYPES = ("fp32", "bf16")
# --matmul (cuda): the library a linear layer's product with a bias goes through. cublas: cublasGemmEx into
# a float32 product, then kernels/matmul.cu's add_bias; cublaslt: one cuBLASLt call whose epilogue adds the
# bias before the single rounding (backend/cuda/cublaslt.py), and with it the MLP's GELU, GELU's derivative
# and the bias gradients (cuda/ops.py). Products without a bias take cublasGemmEx either way.
MATMULS = ("cublas", "cublaslt")


def check_matmul(matmul: str) -> str:
    if matmul not in MATMULS:
        raise XtrainError(must_be("--matmul", one_of(MATMULS), matmul))
    return matmul


# Unit roundoff of bfloat16: round to nearest moves a value by at most this fraction of itself.
BF16_EPS = 2.0 ** -8


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise XtrainError(must_be("--dtype", one_of(DTYPES), dtype))
    return dtype


def check_config(cfg) -> None:
    """--dtype with the options it interacts with; one line naming the problem."""
    check_dtype(cfg.dtype)
    if cfg.dtype == "bf16" and cfg.tf32:
        raise XtrainError("--tf32 makes float32 matmuls use TF32; with --dtype bf16 every matmul is bf16 already: "
                          "drop one of the two")
    if cfg.tf32 and cfg.backend != "cuda":
        raise XtrainError(f"--tf32 is a choice of the cuda backend's matmuls; the {cfg.backend} backend computes in "
                          "float32 only")
    if cfg.matmul not in ("cublas", "auto") and cfg.backend != "cuda":
        raise XtrainError(f"--matmul {cfg.matmul} is a choice of the cuda backend's matmuls; the {cfg.backend} "
                          "backend's products are numpy's")


def bf16_ulp(x) -> np.ndarray:
    """The spacing of bfloat16 numbers at |x| (the distance to the next one away from zero), as float64;
    the spacing at the smallest normal for zeros and subnormals."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    exponent = np.floor(np.log2(np.maximum(x, np.finfo(np.float32).tiny)))
    return np.exp2(exponent - 7)
