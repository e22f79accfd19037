"""The scripts in bin/ as modules, for tests that call their functions: they have no .py suffix, so
`import` cannot find them."""

import importlib.machinery
import importlib.util
from pathlib import Path

BIN = Path(__file__).resolve().parent.parent / "bin"

# a bench_gpu results header with every field its markdown() reads
BENCH_GPU_HEADER = {"date": "2026-11-22", "command": "bin/bench_gpu", "git_commit": "0000000", "gpu": "GPU",
                    "sm_count": 1, "memory_gib": 1, "driver": "1", "cuda_driver_api": "13.0", "cuda_runtime": "13.0",
                    "cupy": "14", "torch": "2", "python": "3", "peak_tflops": None, "steps": 1, "warmup": 1}


def load_script(name: str):
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(BIN / name))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module
