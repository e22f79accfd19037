#!/usr/bin/env bash
# Every GPU test and benchmark of the CUDA backend in one run, within BUDGET seconds (default 540: about 9
# minutes), on a machine with one H100 or H200 (docs/gpu_session.md); it writes one results folder, $OUT.
#
# Run: bash bin/gpu_session.sh   (the [cuda] extra installed; offline, the crt wheels in .whl/crt: docs/gpu_session.md)
# The scripts it runs, each runnable alone as well, and what they share are in bin/gpu_session/.
#
#   1. bin/gpu_session/cuda.sh into $OUT/cuda, CUDA_BUDGET seconds (default 240): tests, the shipped
#      corpus on the GPU, the per-op error tables, memcheck
#   2. bin/gpu_session/bench.sh into $OUT/bench, with the rest of BUDGET (default 540): bench_attention and
#      bench_gemm first (short: attention alone against PyTorch's SDPA backends; the products, their
#      cuBLASLt epilogues and operand orders against PyTorch's), then bench_gpu, the target shapes first
#      (gpt2-124m bf16 at 16 and 64 x 1024 per GPU, ours against torch.compile's default mode at the padded
#      vocabulary), then the fair-peer rows, ours without graphs, the batch sweep's 8 and 32 x 1024, and
#      max-autotune last (what one run leaves out is listed, and docs/gpu_session.md says how a second run
#      goes on), racecheck
#   3. with PACK_RESULTS=1, everything in $OUT/results.tar.gz, beside it only session.txt and the two
#      summaries (a few files to copy off the GPU machine instead of dozens)
# The benchmarks run even where a test failed: their numbers are the run's other half, and a failing
# test is fixed on the CPU afterwards. Exit status: non-zero where either half's script failed (the cuda
# half's is its summary's: the tests' verdicts are in cuda_results.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_session}
BUDGET=${BUDGET:-540}
CUDA_BUDGET=${CUDA_BUDGET:-240}

. bin/gpu_session/common.sh
session_setup
require_gpu

# each half packs nothing itself (PACK_RESULTS=0) and has its own budget, the bench's what is left
OUT="$OUT/cuda" BUDGET=$CUDA_BUDGET PACK_RESULTS=0 bash bin/gpu_session/cuda.sh
cuda_rc=$?
OUT="$OUT/bench" BUDGET=$(( BUDGET - (SECONDS - START) )) PACK_RESULTS=0 bash bin/gpu_session/bench.sh
bench_rc=$?

echo "## gpu_session.sh: cuda exit $cuda_rc, bench exit $bench_rc, $(( SECONDS - START )) s in all" \
  | tee "$OUT/session.txt"
pack_results session.txt cuda/cuda_results.md bench/bench_results.md
exit $(( cuda_rc || bench_rc ))
