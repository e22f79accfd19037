"""xtrain-dist: data-parallel GPT-2 training you can read end to end."""

import os

__version__ = "0.1.0"

# OpenBLAS's worker threads spin for 2^28 cycles (about a tenth of a second) after each product before they sleep.
# A step alternates products with ops that numpy_ops spreads over --cpu-threads threads of its own (GELU,
# layernorm, the softmaxes, AdamW): there a spinning BLAS thread holds a core that an op thread needs, and at 2
# threads on 2 cores the GELU ran no faster than on one. OpenBLAS reads this variable once, when numpy loads it,
# so it is set here, before any of the package's modules imports numpy; a value the user set is kept. At 2^12
# cycles (about 2 microseconds) the workers sleep at once: the mini model's step at --cpu-threads 2 took
# 185-212 ms against 215-251 ms, the tiny model's 66-81 against 82-90 (median of 14 steps, 4 rounds, 2-core EPYC,
# docs/performance.md). Where numpy was imported first (a library user's program), this changes nothing.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")
