#!/usr/bin/env bash
# The CUDA backend's benchmarks in ONE device call, after bin/gpu_session_cuda.sh has passed; results land
# in $OUT for bench/results/.
#
# Device call: command "PACK_RESULTS=1 bash bin/gpu_session_bench.sh", carry [".whl"], timeout_s 600.
#
# What it does, each step recorded even when an earlier one failed:
#   1. the CUDA crt headers (a fresh machine lacks them, and the flash-attention row needs them)
#   2. bin/bench_gpu: our step against PyTorch eager and torch.compile, fp32, tf32 and bf16, ours with
#      --matmul cublas and cublaslt, with the per-op profile of each of our rows (BENCH_GPU_ARGS, default
#      gpt2-124m at 8 x 1024); up to 400 s, since it writes its results files only at the end
#   3. bin/bench_gemm: the products alone, ours against PyTorch's, which says whether the profile's
#      product times are cuBLAS's or ours (BENCH_GEMM_ARGS, default gpt2-124m at 8192 rows)
#   4. compute-sanitizer racecheck over the op tests with what is left of the budget (call 1 runs
#      memcheck; racecheck did not fit beside it)
#   5. $OUT/bench_results.md: each step's exit status and the tables' files
# Time: BUDGET seconds (default 560) for all of it, as in gpu_session_cuda.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_session_bench}
BUDGET=${BUDGET:-560}
BENCH_GPU_ARGS=${BENCH_GPU_ARGS:---presets gpt2-124m --shapes 8x1024 --precisions fp32,tf32,bf16}
BENCH_GEMM_ARGS=${BENCH_GEMM_ARGS:---preset gpt2-124m --tokens 8192}

. bin/gpu_session_common.sh
session_setup
require_gpu
ensure_crt_headers
cat "$OUT/crt.txt"

echo "## bench_gpu"
step bench_gpu 400 $PY bin/bench_gpu $BENCH_GPU_ARGS --out "$OUT" 2>&1 | tee "$OUT/bench_gpu.txt"
gpu_rc=${PIPESTATUS[0]}
echo "## bench_gemm"
step bench_gemm 120 $PY bin/bench_gemm $BENCH_GEMM_ARGS --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.txt"
gemm_rc=${PIPESTATUS[0]}

sanitize racecheck 600
race_rc=$?

# its own summary line, else the log's last line (a missing tool; a run cut short ends mid-way)
race_word=$(grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/sanitizer_racecheck.txt" | tail -n 1)
race_word=${race_word:-last line: $(tail -n 1 "$OUT/sanitizer_racecheck.txt")}
{
  echo "# CUDA backend benchmarks: GPU session"
  echo
  echo "Command: \`bash bin/gpu_session_bench.sh\` ($(( SECONDS - START )) s in all)."
  echo
  echo "- \`bin/bench_gpu $BENCH_GPU_ARGS\`: exit $gpu_rc ($(cd "$OUT" && ls bench_gpu-*.md 2>/dev/null | tr '\n' ' '))"
  echo "- \`bin/bench_gemm $BENCH_GEMM_ARGS\`: exit $gemm_rc ($(cd "$OUT" && ls bench_gemm-*.md 2>/dev/null | tr '\n' ' '))"
  echo "- compute-sanitizer racecheck: exit $race_rc ($race_word)"
  [ -f "$OUT/skipped.txt" ] && sed 's/^## /- /' "$OUT/skipped.txt"
  echo "- CUDA crt headers: $(tail -n 1 "$OUT/crt.txt")"
} > "$OUT/bench_results.md"
cat "$OUT/bench_results.md"
pack_results bench_results.md $(cd "$OUT" && ls bench_gpu-*.md bench_gemm-*.md 2>/dev/null)
exit $(( gpu_rc || gemm_rc || race_rc ))
