"""Test-session setup.

One BLAS thread per process, set before numpy loads OpenBLAS (it sizes its pool once, at load).
The tests run thread ranks on tiny matrices: several ranks each calling a machine-wide OpenBLAS
pool oversubscribe the cores, and on a busy 2-core machine that made a 5-step run 10-50x slower.
No test depends on the thread count: results are compared within one process.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
