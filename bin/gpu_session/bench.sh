#!/usr/bin/env bash
# The CUDA backend's benchmarks, after bin/gpu_session/cuda.sh; results land in $OUT for bench/results/.
# bin/gpu_session.sh runs both in ONE device call (docs/gpu_session.md); alone: command
# "PACK_RESULTS=1 bash bin/gpu_session/bench.sh", carry [".whl"].
#
# What it does, most important first, each step recorded even when an earlier one failed:
#   1. the CUDA crt headers (a fresh machine lacks them, and the flash-attention rows need them)
#   2. bin/bench_gpu, once per entry of BENCH_GPU_RUNS, each into its own folder $OUT/run<i>, most wanted
#      first (torch.compile's compile, about a minute a shape and precision, is most of the time): gpt2-124m at
#      8 x 1024 in bf16 (ours with --matmul cublas and cublaslt, each also with flash attention) against
#      PyTorch eager (SDPA, and attention written out) and torch.compile; the same shape in tf32 and fp32
#      against eager; the bf16 batch x seq sweep against eager and torch.compile (gpt2-124m at 16 and
#      4 x 1024, the small preset at 64 and 16 x 256); then torch.compile in tf32 and fp32 at 8 x 1024.
#      Every row of ours has its per-op profile (one step more): at the small shapes its gaps between ops
#      say whether the host's launches, not the GPU, set the step's time. bench_gpu writes its files after
#      every row, so a run its cap stops keeps the rows it finished.
#   3. bin/bench_gemm: the products alone, ours against PyTorch's, which says whether the profile's product
#      times are cuBLAS's or ours (BENCH_GEMM_ARGS, default gpt2-124m at 8192 rows)
#   4. compute-sanitizer racecheck over the op tests with what is left of the budget
#   5. $OUT/bench_results.md: each step's exit status and the tables' files
# Time: BUDGET seconds (default 330) for all of it, as in gpu_session/cuda.sh; each bench_gpu run has its
# own cap as well (the number before its arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_session_bench}
BUDGET=${BUDGET:-330}
# ';' between runs, each "MAX_SECONDS ARGUMENTS..."; the precisions in order of what issue 6 asks first
BENCH_GPU_RUNS=${BENCH_GPU_RUNS:-"150 --presets gpt2-124m --shapes 8x1024 --precisions bf16;\
100 --presets gpt2-124m --shapes 8x1024 --precisions tf32,fp32 --torch-modes eager,eager-math;\
130 --presets gpt2-124m --shapes 16x1024,4x1024 --precisions bf16 --torch-modes eager,compile;\
100 --presets small --shapes 64x256,16x256 --precisions bf16 --torch-modes eager,compile;\
130 --presets gpt2-124m --shapes 8x1024 --precisions tf32,fp32 --torch-modes compile --matmuls cublas"}
BENCH_GEMM_ARGS=${BENCH_GEMM_ARGS:---preset gpt2-124m --tokens 8192}

. bin/gpu_session/common.sh
session_setup
require_gpu
ensure_crt_headers
cat "$OUT/crt.txt"

IFS=';' read -ra runs <<< "$BENCH_GPU_RUNS"
gpu_rc=0
report=()
for i in "${!runs[@]}"; do
  read -r max args <<< "${runs[$i]}"
  folder="$OUT/run$(( i + 1 ))"
  mkdir -p "$folder"
  echo "## bench_gpu $args"
  step "bench_gpu $args" "$max" $PY bin/bench_gpu $args --out "$folder" 2>&1 | tee "$folder/bench_gpu.txt"
  rc=${PIPESTATUS[0]}
  written=$(cd "$OUT" && ls run$(( i + 1 ))/bench_gpu-*.md 2>/dev/null | tr '\n' ' ')
  # bench_gpu writes after every row: a run stopped by its cap (124) has an incomplete file, and one the
  # budget skipped (124 too) is listed as such; neither is a failure of the benchmark, as an error is
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || gpu_rc=$rc
  report+=("- \`bin/bench_gpu $args\`: exit $rc (${written:-no results file})")
done
echo "## bench_gemm"
step bench_gemm 45 $PY bin/bench_gemm $BENCH_GEMM_ARGS --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.txt"
gemm_rc=${PIPESTATUS[0]}

sanitize racecheck 600
race_rc=$?

# its own summary line, else the log's last line (a missing tool; a run cut short ends mid-way)
race_word=$(grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/sanitizer_racecheck.txt" 2>/dev/null | tail -n 1)
race_word=${race_word:-last line: $(tail -n 1 "$OUT/sanitizer_racecheck.txt" 2>/dev/null)}
{
  echo "# CUDA backend benchmarks: GPU session"
  echo
  echo "Command: \`bash bin/gpu_session/bench.sh\` ($(( SECONDS - START )) s in all)."
  echo
  printf '%s\n' "${report[@]}"
  echo "- \`bin/bench_gemm $BENCH_GEMM_ARGS\`: exit $gemm_rc ($(cd "$OUT" && ls bench_gemm-*.md 2>/dev/null | tr '\n' ' '))"
  echo "- compute-sanitizer racecheck: exit $race_rc ($race_word)"
  [ -f "$OUT/skipped.txt" ] && sed 's/^## /- /' "$OUT/skipped.txt"
  echo "- CUDA crt headers: $(tail -n 1 "$OUT/crt.txt")"
  for table in "$OUT"/run*/bench_gpu-*.md; do  # each run's table of rows, its profiles left in the archive
    [ -f "$table" ] || continue
    echo; echo "## ${table#"$OUT"/}"; echo
    sed -n '/^\*\*Incomplete/p; /^| preset |/,/^$/p' "$table"
  done
} > "$OUT/bench_results.md"
cat "$OUT/bench_results.md"
pack_results bench_results.md  # the tables travel in the archive: a device call brings back 8 files
# racecheck cut by the budget (124) or skipped for want of it is not a failure of the benchmarks
[ "$race_rc" = 124 ] && race_rc=0
exit $(( gpu_rc || gemm_rc || race_rc ))
