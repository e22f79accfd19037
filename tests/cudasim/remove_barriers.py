"""How many missing barriers would the GPU tests catch on the simulator? Removes each __syncthreads()
and __syncwarp() in kernels/ in turn (in a copy of the repository), runs the op tests of the file it
was in on the simulator in forward and reverse order, and prints what caught it.

    python tests/cudasim/remove_barriers.py [--only flash_attention]

A barrier whose removal no test notices is either redundant on the simulator (a shuffle or a WMMA
call right after it also meets the warp, see cudasim.h) or a gap in the tests.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BARRIER = re.compile(r"__sync(threads|warp)\(\);")
# kernel file -> the -k selection of op tests that exercise it (tests/test_cuda_ops.py, test_cuda_bf16.py)
TESTS = {
    "common.cuh": "classifier or global_norm or layernorm or crossentropy or bias",
    "flash_attention.cu": "flash_attention_matches and wmma",
    "flash_attention_mma.cu": "flash_attention_matches and not wmma",
    "attention.cu": "attention or softmax",
    "layernorm.cu": "layernorm",
    "classifier.cu": "classifier or crossentropy",
    "matmul.cu": "matmul or bias",
    "global_norm.cu": "global_norm",
    "encoder.cu": "encoder",
}


def run(copy: Path, selection: str, order: str) -> bool:
    env = dict(os.environ, XTRAIN_CUDASIM="1", XTRAIN_CUDASIM_ORDER=order, XTRAIN_TEST_SEED="1")
    # -o addopts=: one process (pyproject's addopts would start a worker per core for each of these short runs)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                             "-k", selection, "tests/test_cuda_ops.py", "tests/test_cuda_bf16.py"], cwd=copy, env=env,
                            capture_output=True, text=True)
    return result.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one kernel file (stem)")
    args = parser.parse_args()
    copy = Path(tempfile.mkdtemp(prefix="xtrain-barriers-"))
    for part in ("xtrain_dist", "kernels", "tests", "data", "pyproject.toml"):
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy)(ROOT / part, copy / part)
    caught = total = 0
    for path in sorted((copy / "kernels").iterdir()):
        if path.name not in TESTS or (args.only and path.stem != args.only):
            continue
        original = path.read_text()
        lines = original.splitlines(keepends=True)
        for number, line in enumerate(lines, start=1):
            if not BARRIER.search(line):
                continue
            removed = BARRIER.sub("/* removed */", line, count=1)
            path.write_text("".join([*lines[:number - 1], removed, *lines[number:]]))
            failed = [order for order in ("forward", "reverse") if not run(copy, TESTS[path.name], order)]
            total += 1
            caught += bool(failed)
            print(f"{path.name}:{number}: {line.strip()[:70]:70s} caught in: {', '.join(failed) or 'NOT CAUGHT'}",
                  flush=True)
        path.write_text(original)
    print(f"{caught} of {total} removed barriers caught")
    shutil.rmtree(copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
