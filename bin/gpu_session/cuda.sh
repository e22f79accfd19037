#!/usr/bin/env bash
# Everything the CUDA backend needs a GPU for, fp32 and bf16, in a few minutes; results land in $OUT for
# bench/results/. bin/gpu_session.sh runs it first, then bin/gpu_session/bench.sh, in one run on a GPU
# (docs/gpu_session.md); alone: "PACK_RESULTS=1 bash bin/gpu_session/cuda.sh" (offline, with .whl/crt).
#
# What it does, each step recorded even when an earlier one failed, most important first:
#   1. device, driver, versions; the CPU-bound work starts in the background: the per-op error tables at
#      GPT-2 124M shapes in fp32 and bf16 (bin/kernel_errors; its numpy oracle is most of its time) and the
#      numpy loss curves
#   2. the tests, in parallel processes where pytest-xdist is installed, then the
#      real_gpu ones (timings, a command in its own process) alone: the kernels compile (nvcc, NVRTC, both
#      dtypes), every op against numpy in fp32 and bf16, 2 virtual ranks vs 1 vs numpy, bitwise reruns, the
#      CLI trains with a falling loss (tests/test_kernels_compile.py, test_cuda_ops.py, test_cuda_bf16.py)
#   3. the shipped corpus on the GPU: mini, 200 steps, cuda fp32 and bf16 at 1 and 2 virtual ranks, beside
#      numpy fp32 and bf16
#   4. the tf32 error table and cuBLASLt's GELU epilogues against candidate roundings (bin/gelu_epilogue_errors),
#      then compute-sanitizer memcheck over the op tests (SANITIZERS, default
#      memcheck; racecheck takes longer than this budget), each with what is left of the budget
#   5. $OUT/cuda_results.md: device, commands, test summary, error tables, loss curves side by side
#
# Time: one global budget (BUDGET seconds, default 240) caps every step's timeout by what is left, so the
# script always ends, with its summary, inside it; a step with under 20 s left is skipped and listed as
# such. On the H100 (2026-11-26) the whole script took 123 s: the tests 54 s in 8 processes and 9 s for the
# real_gpu ones, each cuda curve 3-8 s, the error tables and numpy curves (66-76 s) beside the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_session_cuda}
BUDGET=${BUDGET:-240}
# what a dry run on the simulator shrinks (tests/test_cudasim.py): the error tables' shapes and the curves' run
KERNEL_ERRORS_ARGS=${KERNEL_ERRORS_ARGS:-}
CURVE=${CURVE:-200 8 128 --model mini --log-every 50}

. bin/gpu_session/common.sh
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
  $PY -c "from xtrain_dist.backend.cuda import cublaslt; print(cublaslt.describe_library())" || true
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

curve_pids=()
errors_pids=()
# the CPU-bound steps run in the background, each with a few BLAS threads of the machine's cores: they end
# with the script, however it ends (a timeout's SIGTERM too), and within the budget
trap 'pids=("${curve_pids[@]}" "${errors_pids[@]}"); [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null' EXIT
trap 'exit 143' TERM INT
for dtype in fp32 bf16; do
  timeout -k 10 $(( BUDGET - 45 )) $PY -m xtrain_dist.train_ddp $CURVE --backend numpy --dtype $dtype --cpu-threads 2 \
    --report "$OUT/curve_numpy_${dtype}_w1.json" > "$OUT/curve_numpy_${dtype}_w1.log" 2>&1 &
  curve_pids+=($!)
done
for dtype in fp32 bf16; do  # kernel_errors.md and kernel_errors_bf16.md; their GPU share is small
  suffix=${dtype/fp32/}
  OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 timeout -k 10 $(( BUDGET - 45 )) $PY bin/kernel_errors --dtype $dtype $KERNEL_ERRORS_ARGS \
    --json "$OUT/kernel_errors${suffix:+_$suffix}.json" --markdown "$OUT/kernel_errors${suffix:+_$suffix}.md" \
    > "$OUT/kernel_errors_${dtype}.log" 2>&1 &
  errors_pids+=($!)
done

echo "## tests"
# TESTS: what pytest runs (the two test_cudasim tests hold the simulator's CuPy stand-in to the real CuPy and cuBLAS: the cuBLAS
# enum values can only be read where libcublas loads, as it does here; test_cublaslt holds the ctypes
# binding to this machine's cublasLt.h and libcublasLt, as CI does to the pip wheel's)
TESTS=${TESTS:-"tests/test_kernels_compile.py tests/test_cuda_ops.py tests/test_cuda_bf16.py tests/test_cublaslt.py
  tests/test_cudasim.py::test_the_stand_in_has_real_cupys_names_values_and_parameters
  tests/test_cudasim.py::test_the_stand_in_cublas_constants_are_cupys"}
# in parallel processes on the one GPU where pytest-xdist is installed: the numpy oracles are most of the
# tests' time, and they are CPU work; the real_gpu tests (timings, peak memory) then run alone (-o addopts=:
# pyproject's addopts would start a worker per core)
PARALLEL=()
$PY -c "import xdist" 2>/dev/null && PARALLEL=(-n "${TEST_WORKERS:-8}")
step tests 150 $PY -m pytest -q -rs -p no:cacheprovider -o addopts= "${PARALLEL[@]}" -m "not real_gpu" $TESTS \
  2>&1 | tee "$OUT/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}
step "tests (real_gpu)" 90 $PY -m pytest -q -rs -p no:cacheprovider -o addopts= -m real_gpu $TESTS 2>&1 \
  | tee -a "$OUT/pytest_cuda.txt"
real_rc=${PIPESTATUS[0]}
[ "$real_rc" = 5 ] && real_rc=0  # 5: none selected
[ "$tests_rc" = 0 ] && tests_rc=$real_rc

echo "## the shipped corpus on the GPU"
curves_rc=0
for run in "fp32 1" "fp32 2" "bf16 1" "bf16 2"; do
  set -- $run
  step "curve cuda $1 w$2" 60 $PY -m xtrain_dist.train_ddp $CURVE --backend cuda --dtype "$1" --world-size "$2" \
    --report "$OUT/curve_cuda_$1_w$2.json" || curves_rc=$?
done
for pid in "${curve_pids[@]}"; do wait "$pid" || curves_rc=$?; done
tail -n 2 "$OUT"/curve_numpy_*.log

echo "## per-op errors"
errors_rc=0
for pid in "${errors_pids[@]}"; do wait "$pid" || errors_rc=$?; done
tail -n 1 "$OUT"/kernel_errors_*.log
step "kernel_errors tf32" 60 $PY bin/kernel_errors --tf32 $KERNEL_ERRORS_ARGS --json "$OUT/kernel_errors_tf32.json" \
  --markdown "$OUT/kernel_errors_tf32.md" || errors_rc=$?
# what cuBLASLt's GELU epilogues round, against the candidates (the bf16 tests' "lt" bound rests on it)
step "gelu_epilogue_errors" 40 $PY bin/gelu_epilogue_errors ${GELU_ROWS:+--rows $GELU_ROWS} \
  --json "$OUT/gelu_epilogue_errors.json" > "$OUT/gelu_epilogue_errors.md" 2>&1 || errors_rc=$?

sanitizer_rc=0
for tool in ${SANITIZERS:-memcheck}; do  # racecheck: gpu_session/bench.sh, with what its budget leaves
  sanitize "$tool" 120 || sanitizer_rc=$?
done

$PY bin/gpu_session/summary "$OUT" "$tests_rc" "$curves_rc" "$errors_rc" "$sanitizer_rc" "$(( SECONDS - START ))"
summary_rc=$?
pack_results cuda_results.md pytest_cuda.txt
exit $summary_rc
