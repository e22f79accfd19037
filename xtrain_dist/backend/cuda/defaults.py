"""What --backend cuda runs where the command line leaves --attention and --matmul at auto: the fastest
configuration bin/bench_gpu measured, as a rule, unless this GPU's tuning table says otherwise.

The rule (docs/cuda_backend.md, "Defaults"):
- attention: cudnn where cuDNN loads and takes the run (bf16, heads of 64 or 128 channels), else flash where
  our kernels take it (bf16, 64-channel heads), else standard. cuDNN's fused attention (through PyTorch's
  SDPA) ran at about 2x our MMA kernels' TFLOP/s (bin/bench_attention, H200, 2026-11-26), and ours ran the
  step faster than standard attention in every bf16 row of bin/bench_gpu (H100, 2026-11-26, gpt2-124m:
  73.2 against 74.8 ms at 16 x 1024, 23.9 against 42.3 ms at 4 x 1024);
- matmul: cublaslt, the fastest row of every dtype in those bin/bench_gpu runs (bf16 with flash 69.9 against
  73.2 ms at 16 x 1024; TF32 1.17x and fp32 0.99x PyTorch eager, against 0.98x with cuBLAS in fp32);
- CUDA graphs: --cuda-graph auto (on where the communicator allows), unchanged.
A table kernels/tuned/<gpu>.json (tuned.py) may hold a section "defaults" ({"attention": ..., "matmul": ...}):
a choice measured faster on that GPU model, taken where this run can use it. numpy runs take standard and
cublas (their only paths), so their results do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...precision import MATMULS
from .attention import FLASH_HS
from .cudnn_sdpa import HEAD_SIZES as CUDNN_HEAD_SIZES

AUTO = "auto"
ATTENTION_ORDER = ("cudnn", "flash", "standard")  # fastest first, as measured


@dataclass(frozen=True)
class Choice:
    attention: str
    matmul: str
    attention_why: str   # "default on a GPU", "this GPU's tuning table", "given"
    matmul_why: str

    def line(self, graphs: str) -> str:
        """The run's first line on a GPU: what it runs and why."""
        return (f"cuda: attention {self.attention} ({self.attention_why}), matmul {self.matmul} ({self.matmul_why}), "
                f"graphs {'on' if graphs == 'auto' else 'off'}")


def attention_fits(attention: str, dtype: str, head_size: int, cudnn_loads) -> bool:
    """Whether this run can take `attention` on the CUDA backend (cudnn_loads: a function, asked last)."""
    if attention == "standard":
        return True
    if dtype != "bf16":
        return False
    if attention == "flash":
        return head_size == FLASH_HS
    return attention == "cudnn" and head_size in CUDNN_HEAD_SIZES and cudnn_loads()


def choose(attention: str, matmul: str, dtype: str, head_size: int, table: dict, cudnn_loads,
           dropout: float = 0.0) -> Choice:
    """The CUDA run's attention and matmul: each as given, or at auto from the tuning table's "defaults"
    section (where the run can take it), else from the rule. With --dropout the fused kernels never hold the
    probabilities to drop, so auto is standard attention."""
    tuned = table.get("defaults", {}) if isinstance(table.get("defaults", {}), dict) else {}
    attention_why = matmul_why = "given"
    if attention == AUTO:
        wanted = tuned.get("attention")
        if dropout:
            attention, attention_why = "standard", "--dropout needs it"
        elif wanted in ATTENTION_ORDER and attention_fits(wanted, dtype, head_size, cudnn_loads):
            attention, attention_why = wanted, "this GPU's tuning table"
        else:
            attention = next(a for a in ATTENTION_ORDER if attention_fits(a, dtype, head_size, cudnn_loads))
            attention_why = "default on a GPU"
    if matmul == AUTO:
        wanted = tuned.get("matmul")
        matmul, matmul_why = (wanted, "this GPU's tuning table") if wanted in MATMULS else ("cublaslt",
                                                                                           "default on a GPU")
    return Choice(attention, matmul, attention_why, matmul_why)
