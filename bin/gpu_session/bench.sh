#!/usr/bin/env bash
# The CUDA backend's benchmarks, after bin/gpu_session/cuda.sh; results land in $OUT for bench/results/.
# bin/gpu_session.sh runs both in one run on a GPU (docs/gpu_session.md); alone:
# "PACK_RESULTS=1 bash bin/gpu_session/bench.sh" (offline, with the crt wheels in .whl/crt).
#
# What it does, the headline first, each step recorded even when an earlier one failed (a step that fails is
# a line of the summary with its exit status and the last line it printed, and the next step runs):
#   1. the CUDA crt headers (a fresh machine lacks them, and the flash-attention rows need them)
#   2. bin/bench_gpu, once per entry of BENCH_GPU_RUNS from the BENCH_GPU_FROM-th (default the first), each
#      into its own folder $OUT/run<i>, most wanted first. Run 1 is the headline, in about the first 4
#      minutes of a fresh H100 or H200: gpt2-124m bf16 at 16 and 64 x 1024 per GPU, ours on every attention
#      path (ATTENTION_PATHS, default flash, cudnn and standard: a path this version's model does not have is
#      a row that records the refusal) with the step replayed from a CUDA graph and without, --matmul cublas
#      and cublaslt, each row with its per-op profile, against torch.compile in its default mode at nanoGPT's
#      padded vocabulary (V = 50304)
#   3. after run SWEEPS_AFTER (default 1), the sweeps: bin/bench_attention (attention alone, our flash kernels
#      against each of PyTorch's SDPA backends; BENCH_ATTENTION_ARGS) and bin/bench_gemm --search (the
#      products alone against PyTorch's, after the search of cuBLASLt's top algorithms for every product the
#      step runs, whose fastest go into kernels/tuned/<gpu>.json, copied to $OUT/tuned/; BENCH_GEMM_ARGS), with
#      nvmath-python for its call-cost row installed for that step alone from .whl/nvmath/ where carried
#   4. the runs after: ours through cuBLASLt again, now with the algorithms the search chose (run 2); the
#      rows that show the peer was not weakened (PyTorch unpadded, eager; 3, 4); the per-GPU batch sweep's 8
#      and 32 x 1024 (5); last max-autotune, padded at 16, then 64 x 1024, then unpadded (6-8), whose compile
#      took over 150 s a shape on an H200, so it goes where it cannot take the others' time. No --recompute:
#      train/memory.py's bound for gpt2-124m bf16 at 64 x 1024 with flash attention is 26.6 GiB (44.5 with
#      standard attention), well inside an H100's 80 GB. bench_gpu writes its files after every row and an
#      error ends one row, not the run, so a run its cap stops keeps the rows it finished; what the budget
#      leaves out is listed, with its run number, for BENCH_GPU_FROM to start at.
#   5. compute-sanitizer racecheck over the op tests with what is left of the budget
#   6. $OUT/bench_results.md: our best row against PyTorch's best over every run (gpu_session/bench_summary),
#      each step's exit status and the tables' files
# Time: BUDGET seconds (default 330) for all of it, as in gpu_session/cuda.sh; each bench_gpu run has its
# own cap as well (the number before its arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_session_bench}
BUDGET=${BUDGET:-330}
# every attention path of ours the headline times: one the model does not have is a row recording why
ATTENTION_PATHS=${ATTENTION_PATHS:-flash,cudnn,standard}
# ';' between runs, each "MAX_SECONDS ARGUMENTS..." (an empty list is written --option=, as word splitting
# keeps quotes); the headline first
TARGETS="--presets gpt2-124m --precisions bf16"
BENCH_GPU_RUNS=${BENCH_GPU_RUNS:-"220 $TARGETS --shapes 16x1024,64x1024 --attentions $ATTENTION_PATHS \
--cuda-graphs on,off --matmuls cublas,cublaslt --torch-modes compile-default --torch-vocabs padded;\
60 $TARGETS --shapes 16x1024,64x1024 --attentions $ATTENTION_PATHS --cuda-graphs on --matmuls cublaslt --torch-modes=;\
150 $TARGETS --shapes 16x1024,64x1024 --attentions= --torch-modes compile-default,eager --torch-vocabs unpadded;\
60 $TARGETS --shapes 16x1024,64x1024 --attentions= --torch-modes eager --torch-vocabs padded;\
150 $TARGETS --shapes 8x1024,32x1024 --attentions flash --torch-modes compile-default,eager --torch-vocabs padded;\
400 $TARGETS --shapes 16x1024 --attentions= --torch-modes compile-max-autotune --torch-vocabs padded;\
400 $TARGETS --shapes 64x1024 --attentions= --torch-modes compile-max-autotune --torch-vocabs padded;\
500 $TARGETS --shapes 16x1024,64x1024 --attentions= --torch-modes compile-max-autotune --torch-vocabs unpadded"}
BENCH_GPU_FROM=${BENCH_GPU_FROM:-1}
SWEEPS_AFTER=${SWEEPS_AFTER:-1}
BENCH_GEMM_ARGS=${BENCH_GEMM_ARGS:---preset gpt2-124m --tokens 8192 --precisions bf16 --search}
BENCH_ATTENTION_ARGS=${BENCH_ATTENTION_ARGS:-}
# where bench_gemm --search writes the GPU's tuning table (its --tuned-dir where BENCH_GEMM_ARGS gives one)
TUNED_DIR=${TUNED_DIR:-kernels/tuned}

. bin/gpu_session/common.sh
session_setup
require_gpu
ensure_crt_headers
cat "$OUT/crt.txt"

# why a step failed, for its line of the summary: the last line it printed (an exit status alone says little)
why() {
  local rc=$1 log=$2
  [ "$rc" = 0 ] && return 0
  printf '; last line: %s' "$(tail -n 1 "$log" 2>/dev/null | tr -d '`' | cut -c1-200)"
}

# the sweeps: attention alone, then the products' algorithm search and the products alone
attention_rc=0
gemm_rc=0
sweeps=pending
run_sweeps() {
  echo "## bench_attention"
  step bench_attention 120 $PY bin/bench_attention $BENCH_ATTENTION_ARGS --out "$OUT" 2>&1 | tee "$OUT/bench_attention.txt"
  attention_rc=${PIPESTATUS[0]}

  echo "## bench_gemm"
  local nvmath_site="" nvmath_wheel
  nvmath_wheel=$(ls .whl/nvmath/nvmath_python-*.whl 2>/dev/null | tail -n 1)
  if [ -n "$nvmath_wheel" ] && ! $PY -c "import nvmath.bindings.cublasLt" 2>/dev/null; then
    nvmath_site=$(mktemp -d)  # outside $OUT: the results do not carry a library
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$nvmath_site" "$nvmath_wheel" \
      > "$OUT/nvmath.txt" 2>&1 || nvmath_site=""
  fi
  step bench_gemm 120 env PYTHONPATH="${nvmath_site:+$nvmath_site:}${PYTHONPATH:-}" $PY bin/bench_gemm $BENCH_GEMM_ARGS \
    --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.txt"
  gemm_rc=${PIPESTATUS[0]}
  # the tuning tables (the one the search wrote), to come back with the results: the checkout does not
  if ls "$TUNED_DIR"/*.json >/dev/null 2>&1; then
    mkdir -p "$OUT/tuned" && cp "$TUNED_DIR"/*.json "$OUT/tuned/"
  fi
  sweeps=ran
}
# a second run that goes on from bench_gpu run N > SWEEPS_AFTER skips the sweeps: the first run ran them
[ "$BENCH_GPU_FROM" -gt "$SWEEPS_AFTER" ] && sweeps=skipped
[ "$sweeps" = pending ] && [ "$SWEEPS_AFTER" = 0 ] && run_sweeps

IFS=';' read -ra runs <<< "$BENCH_GPU_RUNS"
gpu_rc=0
report=()
for i in "${!runs[@]}"; do
  if [ $(( i + 1 )) -ge "$BENCH_GPU_FROM" ]; then  # a second call goes on where the first stopped
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
    report+=("- run $(( i + 1 )): \`bin/bench_gpu $args\`: exit $rc (${written:-no results file}$(why "$rc" "$folder/bench_gpu.txt"))")
  fi
  [ "$sweeps" = pending ] && [ $(( i + 1 )) = "$SWEEPS_AFTER" ] && run_sweeps
done
[ "$sweeps" = pending ] && run_sweeps  # fewer runs than SWEEPS_AFTER
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
  if [ "$sweeps" = ran ]; then
    written=$(cd "$OUT" && ls bench_attention-*.md 2>/dev/null | tr '\n' ' ')
    echo "- \`bin/bench_attention $BENCH_ATTENTION_ARGS\`: exit $attention_rc (${written:-no results file}$(why "$attention_rc" "$OUT/bench_attention.txt"))"
    written=$(cd "$OUT" && ls bench_gemm-*.md tuned/*.json 2>/dev/null | tr '\n' ' ')
    echo "- \`bin/bench_gemm $BENCH_GEMM_ARGS\`: exit $gemm_rc (${written:-no results file}$(why "$gemm_rc" "$OUT/bench_gemm.txt"))"
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
