"""Run a command of this repository with `import cupy` giving the CUDA simulator (see README.md).

    python tests/cudasim/run.py -m xtrain_dist.train_ddp 20 8 64 --backend cuda --model tiny
    python tests/cudasim/run.py bin/bench_gpu --presets tiny --shapes 2x32 --torch-modes '' --out /tmp/b

For the tests that start their own process, and for trying a script's CUDA path before a GPU session.
"""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# this checkout's xtrain_dist, not whichever one the Python running this has installed: -m below runs
# with this file's folder on the path, not the working directory
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
import fake_cudnn
import fake_cupy
import fake_nccl

fake_cupy.install()
fake_nccl.install()
# cuDNN (--attention cudnn) only with XTRAIN_CUDASIM_CUDNN=1: its stand-in; else `import cudnn` fails, as on a
# machine without the package, whether or not this one has it
fake_cudnn.install() if os.environ.get("XTRAIN_CUDASIM_CUDNN") == "1" else fake_cudnn.block()

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: run.py -m MODULE [ARGS...] | run.py SCRIPT [ARGS...]")
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, sys.argv = sys.argv[1], sys.argv[1:]
        runpy.run_path(script, run_name="__main__")
