"""Training precision (`--dtype`): what is stored in bfloat16, and the host-side bfloat16 helpers.

fp32: everything float32 (matmuls may still use TF32 tensor cores with --tf32).
bf16: mixed precision as llm.c does it. Activations, and a copy of the parameters that forward and
      backward read (`GPT2.params_lowp`), are bfloat16; matmuls take bfloat16 inputs on tensor cores
      and accumulate in float32. Parameter gradients, the float32 master parameters, AdamW's m and v,
      layernorm statistics, attention scores, losses and every reduction stay float32.

bfloat16 is float32's upper 16 bits: the same 8-bit exponent (so the same range: no loss scaling is
needed, unlike float16) with 7 mantissa bits instead of 23, i.e. 2-3 significant decimal digits
(unit roundoff 2^-8 ~ 0.4%). The CUDA backend stores it as real 16-bit values (uint16 arrays holding
the bits, see cuda_ops); the numpy backend emulates it in float32 storage by rounding every value
the GPU would store in bfloat16 (numpy_ops.NumpyBackend.store). The helpers below convert between
the two on the host.
"""

import numpy as np

from .errors import XtrainError

DTYPES = ("fp32", "bf16")

# Unit roundoff of bfloat16: round to nearest moves a value by at most this fraction of itself.
BF16_EPS = 2.0 ** -8


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise XtrainError(f"unknown --dtype '{dtype}' (choose from {', '.join(DTYPES)})")
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
    if cfg.matmul != "cublas" and cfg.backend != "cuda":
        raise XtrainError(f"--matmul {cfg.matmul} is a choice of the cuda backend's matmuls; the {cfg.backend} "
                          "backend's products are numpy's")


def bf16_bits(x) -> np.ndarray:
    """The uint16 bits of the bfloat16 nearest to each float32 value (ties to even; NaN stays NaN)."""
    from .backend.numpy_ops import bf16_round

    rounded = np.array(x, dtype=np.float32)  # a copy: bf16_round works in place
    bf16_round(rounded)
    return (rounded.view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits) -> np.ndarray:
    """float32 values of bfloat16 bits: exact, widening only appends 16 zero bits."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_ulp(x) -> np.ndarray:
    """The spacing of bfloat16 numbers at |x| (the distance to the next one away from zero), as float64;
    the spacing at the smallest normal for zeros and subnormals."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    exponent = np.floor(np.log2(np.maximum(x, np.finfo(np.float32).tiny)))
    return np.exp2(exponent - 7)
