#!/usr/bin/env bash
# Every GPU test and benchmark of the CUDA backend in one run, within BUDGET seconds (default 540: about 9
# minutes), on a machine with one H100 or H200 (docs/gpu_session.md); it writes one results folder, $OUT.
#
# Run: bash bin/gpu_session.sh   (the [cuda] extra installed; offline, the crt wheels in .whl/crt: docs/gpu_session.md)
# The scripts it runs, each runnable alone as well, and what they share are in bin/gpu_session/.
#
#   1. bin/gpu_session/bench.sh into $OUT/bench, BUDGET - CUDA_BUDGET seconds (default 360), the headline
#      first: gpt2-124m bf16 at 16 and 64 x 1024 per GPU, ours on every attention path with the step
#      replayed from a CUDA graph and without, each with its per-op profile, against torch.compile's
#      default mode at the padded vocabulary (about the first 4 minutes); then the sweeps (bench_attention,
#      bench_gemm's algorithm search, whose table the next run of ours uses), the fair-peer rows, the batch
#      sweep's 8 and 32 x 1024, and max-autotune last (what one run leaves out is listed, and
#      docs/gpu_session.md says how a second run goes on), racecheck
#   2. bin/gpu_session/cuda.sh into $OUT/cuda, with what is left (CUDA_BUDGET seconds, default 180, when the
#      bench half takes all of its own): the tests, the shipped corpus on the GPU, the per-op error tables,
#      memcheck
#   3. with PACK_RESULTS=1, everything in $OUT/results.tar.gz, beside it only session.txt and the two
#      summaries (a few files to copy off the GPU machine instead of dozens)
# The headline goes first because a GPU run is rare and short: the figure users compare (our step against
# torch.compile) must not wait behind the tests, and a failing row or test is a result, fixed on the CPU
# afterwards. Exit status: non-zero where either half's script failed (the cuda
# half's is its summary's: the tests' verdicts are in cuda_results.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_session}
BUDGET=${BUDGET:-540}
CUDA_BUDGET=${CUDA_BUDGET:-180}

. bin/gpu_session/common.sh
session_setup
require_gpu

# each half packs nothing itself (PACK_RESULTS=0) and has its own budget: the bench half all but
# CUDA_BUDGET, the cuda half what is left after it
OUT="$OUT/bench" BUDGET=$(( BUDGET - CUDA_BUDGET )) PACK_RESULTS=0 bash bin/gpu_session/bench.sh
bench_rc=$?
OUT="$OUT/cuda" BUDGET=$(( BUDGET - (SECONDS - START) )) PACK_RESULTS=0 bash bin/gpu_session/cuda.sh
cuda_rc=$?

echo "## gpu_session.sh: cuda exit $cuda_rc, bench exit $bench_rc, $(( SECONDS - START )) s in all" \
  | tee "$OUT/session.txt"
pack_results session.txt cuda/cuda_results.md bench/bench_results.md
exit $(( cuda_rc || bench_rc ))
