"""With this folder on PYTHONPATH and XTRAIN_CUDASIM=1, every Python process started (python3 -m pytest,
train_ddp, bin/kernel_errors, the workers of a shell script) imports the simulator's cupy and nccl
(tests/cudasim): how the GPU session's own scripts are dry-run on a CPU, unchanged:

    XTRAIN_CUDASIM=1 PYTHONPATH=tests/cudasim/site BUDGET=120 OUT=/tmp/dry bash bin/gpu_session/cuda.sh

Without XTRAIN_CUDASIM=1 it does nothing.
"""

import os
import sys
from pathlib import Path

if os.environ.get("XTRAIN_CUDASIM") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import fake_cudnn
    import fake_cupy
    import fake_nccl

    fake_cupy.install()
    fake_nccl.install()
    fake_cudnn.install() if os.environ.get("XTRAIN_CUDASIM_CUDNN") == "1" else fake_cudnn.block()
