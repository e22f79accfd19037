#!/usr/bin/env bash
# The CUDA backend's benchmarks, after bin/gpu_session/cuda.sh; results land in $OUT for bench/results/.
# bin/gpu_session.sh runs both in one run on a GPU (docs/gpu_session.md); alone:
# "PACK_RESULTS=1 bash bin/gpu_session/bench.sh" (offline, with the crt wheels in .whl/crt).
#
# What it does, most important first, each step recorded even when an earlier one failed:
#   1. the CUDA crt headers (a fresh machine lacks them, and the flash-attention rows need them)
#   1b. bin/bench_attention: attention alone, forward and backward, our flash kernels (flash_attention_mma.cu
#      and the WMMA ones it replaced) against each of PyTorch's SDPA backends at 8x12x1024x64,
#      16x12x1024x64 and 4x16x2048x64
#      (BENCH_ATTENTION_ARGS, default its own); a minute, so it goes before the long bench_gpu runs
#   2. bin/bench_gemm: the products alone, ours against PyTorch's, which says whether the profile's product
#      times are cuBLAS's or ours (BENCH_GEMM_ARGS, default gpt2-124m at 8192 rows); the open questions
#      first, since it is short: each product in PyTorch's operand order ("product tn"), the cuBLASLt
#      epilogues (bias gradient, GELU and its derivative) against PyTorch's, and a cuBLASLt call's host
#      cost through ctypes and through nvmath-python, installed for this step alone from .whl/nvmath/ where
#      it is carried (docs/gpu_session.md) and missing
#   3. bin/bench_gpu, once per entry of BENCH_GPU_RUNS from the BENCH_GPU_FROM-th (default the first), each
#      into its own folder $OUT/run<i>, most wanted first (torch.compile's compile, 20-40 s a shape and mode,
#      and max-autotune's, minutes, are most of the time). The target shapes first: gpt2-124m bf16 at 16 and
#      64 x 1024 per GPU, ours with flash attention (--matmul cublas and cublaslt) against torch.compile in
#      its default mode at nanoGPT's padded vocabulary (run 1); then the rows that show the peer was not
#      weakened (PyTorch unpadded, eager) at those shapes (2, 3); ours without graphs and with standard
#      attention (4); the per-GPU batch sweep's other two, 8 and 32 x 1024 (5); last max-autotune, padded at
#      16, then 64 x 1024, then unpadded (6-8), whose compile took over 150 s a shape on an H200, so it has a
#      cap of its own per shape and goes where it cannot take the others' time. No
#      --recompute: train/memory.py's bound for gpt2-124m bf16 at 64 x 1024 with flash attention is 26.6 GiB
#      (44.5 with standard attention), well inside an H100's 80 GB. Every row of ours has its per-op profile
#      (one step more). bench_gpu writes its files after every row, so a run its cap stops keeps the rows it
#      finished; what the budget leaves out is listed, with its run number, for BENCH_GPU_FROM to start at.
#   4. compute-sanitizer racecheck over the op tests with what is left of the budget
#   5. $OUT/bench_results.md: our best row against PyTorch's best over every run (gpu_session/bench_summary),
#      each step's exit status and the tables' files
# Time: BUDGET seconds (default 330) for all of it, as in gpu_session/cuda.sh; each bench_gpu run has its
# own cap as well (the number before its arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_session_bench}
BUDGET=${BUDGET:-330}
# ';' between runs, each "MAX_SECONDS ARGUMENTS..." (an empty list is written --option=, as word splitting
# keeps quotes); the target shapes first
TARGETS="--presets gpt2-124m --precisions bf16"
BENCH_GPU_RUNS=${BENCH_GPU_RUNS:-"170 $TARGETS --shapes 16x1024,64x1024 --attentions flash --cuda-graphs on \
--torch-modes compile-default --torch-vocabs padded;\
150 $TARGETS --shapes 16x1024,64x1024 --attentions= --torch-modes compile-default,eager --torch-vocabs unpadded;\
60 $TARGETS --shapes 16x1024,64x1024 --attentions= --torch-modes eager --torch-vocabs padded;\
90 $TARGETS --shapes 16x1024,64x1024 --attentions flash,standard --cuda-graphs off --torch-modes=;\
150 $TARGETS --shapes 8x1024,32x1024 --attentions flash --torch-modes compile-default,eager --torch-vocabs padded;\
400 $TARGETS --shapes 16x1024 --attentions= --torch-modes compile-max-autotune --torch-vocabs padded;\
400 $TARGETS --shapes 64x1024 --attentions= --torch-modes compile-max-autotune --torch-vocabs padded;\
500 $TARGETS --shapes 16x1024,64x1024 --attentions= --torch-modes compile-max-autotune --torch-vocabs unpadded"}
BENCH_GPU_FROM=${BENCH_GPU_FROM:-1}
BENCH_GEMM_ARGS=${BENCH_GEMM_ARGS:---preset gpt2-124m --tokens 8192}
BENCH_ATTENTION_ARGS=${BENCH_ATTENTION_ARGS:-}

. bin/gpu_session/common.sh
session_setup
require_gpu
ensure_crt_headers
cat "$OUT/crt.txt"

# a second run that goes on from bench_gpu run N > 1 (BENCH_GPU_FROM) skips what came before run 1 as well
before_runs=$([ "$BENCH_GPU_FROM" -gt 1 ] && echo skip || echo run)
attention_rc=0
gemm_rc=0
if [ "$before_runs" = run ]; then
  echo "## bench_attention"
  step bench_attention 120 $PY bin/bench_attention $BENCH_ATTENTION_ARGS --out "$OUT" 2>&1 | tee "$OUT/bench_attention.txt"
  attention_rc=${PIPESTATUS[0]}

  echo "## bench_gemm"
  nvmath_site=""
  nvmath_wheel=$(ls .whl/nvmath/nvmath_python-*.whl 2>/dev/null | tail -n 1)
  if [ -n "$nvmath_wheel" ] && ! $PY -c "import nvmath.bindings.cublasLt" 2>/dev/null; then
    nvmath_site=$(mktemp -d)  # outside $OUT: the results do not carry a library
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$nvmath_site" "$nvmath_wheel" \
      > "$OUT/nvmath.txt" 2>&1 || nvmath_site=""
fi
step bench_gemm 75 env PYTHONPATH="${nvmath_site:+$nvmath_site:}${PYTHONPATH:-}" $PY bin/bench_gemm $BENCH_GEMM_ARGS \
  --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.txt"
gemm_rc=${PIPESTATUS[0]}
fi

IFS=';' read -ra runs <<< "$BENCH_GPU_RUNS"
gpu_rc=0
report=()
for i in "${!runs[@]}"; do
  [ $(( i + 1 )) -lt "$BENCH_GPU_FROM" ] && continue  # a second call goes on where the first stopped
  read -r max args <<< "${runs[$i]}"
  folder="$OUT/run$(( i + 1 ))"
  mkdir -p "$folder"
  echo "## bench_gpu $args"
  step "bench_gpu run $(( i + 1 )): $args" "$max" $PY bin/bench_gpu $args --out "$folder" 2>&1 \
    | tee "$folder/bench_gpu.txt"
  rc=${PIPESTATUS[0]}
  written=$(cd "$OUT" && ls run$(( i + 1 ))/bench_gpu-*.md 2>/dev/null | tr '\n' ' ')
  # bench_gpu writes after every row: a run stopped by its cap (124) has an incomplete file, and one the
  # budget skipped (124 too) is listed as such; neither is a failure of the benchmark, as an error is
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || gpu_rc=$rc
  report+=("- run $(( i + 1 )): \`bin/bench_gpu $args\`: exit $rc (${written:-no results file})")
done
sanitize racecheck 600
race_rc=$?

# its own summary line, else the log's last line (a missing tool; a run cut short ends mid-way)
race_word=$(grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/sanitizer_racecheck.txt" 2>/dev/null | tail -n 1)
race_word=${race_word:-last line: $(tail -n 1 "$OUT/sanitizer_racecheck.txt" 2>/dev/null)}
best=$($PY bin/gpu_session/bench_summary "$OUT" 2>&1)
{
  echo "# CUDA backend benchmarks on a GPU"
  echo
  echo "Command: \`bash bin/gpu_session/bench.sh\` ($(( SECONDS - START )) s in all)."
  echo
  echo "## Our best row against PyTorch's best"
  echo
  echo "$best"
  echo
  printf '%s\n' "${report[@]}"
  if [ "$before_runs" = run ]; then
    echo "- \`bin/bench_gemm $BENCH_GEMM_ARGS\`: exit $gemm_rc ($(cd "$OUT" && ls bench_gemm-*.md 2>/dev/null | tr '\n' ' '))"
    echo "- \`bin/bench_attention $BENCH_ATTENTION_ARGS\`: exit $attention_rc ($(cd "$OUT" && ls bench_attention-*.md 2>/dev/null | tr '\n' ' '))"
  else
    echo "- bench_attention and bench_gemm: not run (BENCH_GPU_FROM=$BENCH_GPU_FROM: the first run ran them)"
  fi
  echo "- compute-sanitizer racecheck: exit $race_rc ($race_word)"
  [ -f "$OUT/skipped.txt" ] && sed 's/^## /- /' "$OUT/skipped.txt"
  echo "- CUDA crt headers: $(tail -n 1 "$OUT/crt.txt")"
  for table in "$OUT"/bench_attention-*.md; do  # attention alone: every row, then ours against torch's best
    [ -f "$table" ] || continue
    echo; echo "## ${table#"$OUT"/}"; echo
    sed -n '/^| B x NH x T x hs |/,/^$/p' "$table"
  done
  for table in "$OUT"/run*/bench_gpu-*.md; do  # each run's table of rows, its profiles left in the archive
    [ -f "$table" ] || continue
    echo; echo "## ${table#"$OUT"/}"; echo
    sed -n '/^\*\*Incomplete/p; /^| preset | B x T | precision | impl |/,/^$/p' "$table"
  done
} > "$OUT/bench_results.md"
cat "$OUT/bench_results.md"
pack_results bench_results.md  # the tables travel in the archive: the GPU machine gives back a few files
# racecheck cut by the budget (124) or skipped for want of it is not a failure of the benchmarks
[ "$race_rc" = 124 ] && race_rc=0
exit $(( gpu_rc || gemm_rc || attention_rc || race_rc ))
