#!/usr/bin/env bash
# Everything the CUDA backend needs a GPU for, fp32 and bf16, in ONE device call; results land in $OUT
# for bench/results/.
#
# Device call: command "PACK_RESULTS=1 SANITIZERS=memcheck bash bin/gpu_session_cuda.sh", carry [".whl"],
# timeout_s 600 (the image has CuPy and torch; .whl/crt/ holds the CUDA crt headers its pip CUDA may
# lack, see ensure_crt_headers). The benchmarks and racecheck are a separate call, bin/gpu_session_bench.sh
# (docs/gpu_session.md).
#
# What it does, each step recorded even when an earlier one failed, most important first:
#   1. device, driver, versions; the CPU (numpy) loss curves start in the background
#   2. the kernels compile (nvcc, NVRTC, both dtypes) and every op against numpy, fp32 and bf16, 2 virtual
#      ranks vs 1 vs numpy, bitwise reruns, the CLI trains with a falling loss:
#      tests/test_kernels_compile.py, test_cuda_ops.py, test_cuda_bf16.py
#   3. the shipped corpus on the GPU: mini, 200 steps, cuda fp32 and bf16 at 1 and 2 virtual ranks, beside
#      numpy fp32 and bf16
#   4. the per-op error tables at GPT-2 124M shapes (bin/kernel_errors): fp32, bf16 (in bf16 ulps), tf32
#   5. compute-sanitizer memcheck and racecheck (SANITIZERS, default both) over the op tests, fp32 and
#      the bf16 scalar paths
#   6. $OUT/cuda_results.md: device, commands, test summary, error tables, loss curves side by side
#
# Time: one global budget (BUDGET seconds, default 540) caps every step's timeout by what is left, so the
# script always ends, with its summary, inside the 600 s call; a step with under 20 s left is skipped and
# listed as such. Expected on an H100 (estimates, not yet measured): tests 3-4 min (about half of it the
# numpy side of the op comparisons and the two compiles of 12 files), curves under 1 min (the numpy ones run
# meanwhile on the CPU), error tables about 1.5 min (the numpy oracle at 124M shapes), sanitizers the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_session_cuda}
BUDGET=${BUDGET:-540}

. bin/gpu_session_common.sh
session_setup
require_gpu
ensure_crt_headers

{
  echo "## device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "## date"; date -u +%Y-%m-%dT%H:%MZ
  echo "## versions"
  $PY -m pip list 2>/dev/null | grep -i -E "^(cupy|cupy-cuda13x|cuda-core|cuda-bindings|numpy|torch|tokenizers) " || true
  nvcc --version 2>/dev/null | tail -1
  echo "## CUDA crt headers (flash attention)"; cat "$OUT/crt.txt"
  echo "## cuBLASLt (--matmul cublaslt)"
  $PY -c "from xtrain_dist.backend import cublaslt; print(cublaslt.describe_library())" || true
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

CURVE="200 8 128 --model mini --log-every 50"
numpy_pids=()
# the CPU curves run in the background: they end with the script, however it ends (a timeout's SIGTERM too)
trap '[ ${#numpy_pids[@]} -gt 0 ] && kill "${numpy_pids[@]}" 2>/dev/null' EXIT
trap 'exit 143' TERM INT
for dtype in fp32 bf16; do  # CPU only: they run while the GPU works, four BLAS threads each, inside the budget
  timeout -k 10 $(( BUDGET - 45 )) $PY -m xtrain_dist.train_ddp $CURVE --backend numpy --dtype $dtype --cpu-threads 4 \
    --report "$OUT/curve_numpy_${dtype}_w1.json" > "$OUT/curve_numpy_${dtype}_w1.log" 2>&1 &
  numpy_pids+=($!)
done

echo "## tests"
# (the two test_cudasim tests hold the simulator's CuPy stand-in to the real CuPy and cuBLAS: the cuBLAS
# enum values can only be read where libcublas loads, as it does here; test_cublaslt holds the ctypes
# binding to this image's cublasLt.h and libcublasLt, as CI does to the pip wheel's)
step tests 330 $PY -m pytest -q -rs tests/test_kernels_compile.py tests/test_cuda_ops.py tests/test_cuda_bf16.py \
  tests/test_cublaslt.py \
  "tests/test_cudasim.py::test_the_stand_in_has_real_cupys_names_values_and_parameters" \
  "tests/test_cudasim.py::test_the_stand_in_cublas_constants_are_cupys" \
  2>&1 | tee "$OUT/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}

echo "## the shipped corpus on the GPU"
curves_rc=0
for run in "fp32 1" "fp32 2" "bf16 1" "bf16 2"; do
  set -- $run
  step "curve cuda $1 w$2" 60 $PY -m xtrain_dist.train_ddp $CURVE --backend cuda --dtype "$1" --world-size "$2" \
    --report "$OUT/curve_cuda_$1_w$2.json" || curves_rc=$?
done
for pid in "${numpy_pids[@]}"; do wait "$pid" || curves_rc=$?; done
tail -n 2 "$OUT"/curve_numpy_*.log

echo "## per-op errors"
errors_rc=0
step "kernel_errors fp32" 75 $PY bin/kernel_errors --json "$OUT/kernel_errors.json" --markdown "$OUT/kernel_errors.md" \
  || errors_rc=$?
step "kernel_errors bf16" 75 $PY bin/kernel_errors --dtype bf16 --json "$OUT/kernel_errors_bf16.json" \
  --markdown "$OUT/kernel_errors_bf16.md" || errors_rc=$?
step "kernel_errors tf32" 60 $PY bin/kernel_errors --tf32 --json "$OUT/kernel_errors_tf32.json" \
  --markdown "$OUT/kernel_errors_tf32.md" || errors_rc=$?

sanitizer_rc=0
for tool in ${SANITIZERS:-memcheck racecheck}; do  # docs/gpu_session.md's call 1 leaves racecheck to call 3
  sanitize "$tool" 120 || sanitizer_rc=$?
done

$PY bin/gpu_session_summary "$OUT" "$tests_rc" "$curves_rc" "$errors_rc" "$sanitizer_rc" "$(( SECONDS - START ))"
summary_rc=$?
pack_results cuda_results.md pytest_cuda.txt
exit $summary_rc
