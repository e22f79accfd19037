# Sourced by bin/gpu_session.sh and the bin/gpu_session/*.sh scripts: what they need before their first
# step, their steps' time budget, and the packing of their results into one archive.

# session_setup: once a script has set OUT and BUDGET, what each one with a time budget does first: $OUT made
# and cleared of the last run's skip list, Python unbuffered with the repository importable, PY (the python
# that runs every step; the tests set their own) and the budget's START
session_setup() {
  mkdir -p "$OUT"
  rm -f "$OUT/skipped.txt"
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  PY=${PY:-python3}
  START=$SECONDS
}

# step NAME MAX_SECONDS COMMAND...: run COMMAND under min(MAX_SECONDS, what is left of the budget: BUDGET
# seconds from START, 15 kept for the summary); a step with under 20 s left is skipped and listed in
# $OUT/skipped.txt (exit 124)
step() {
  local name=$1 max=$2 left
  shift 2
  left=$(( BUDGET - (SECONDS - START) - 15 ))
  [ "$left" -lt "$max" ] && max=$left
  if [ "$max" -lt 20 ]; then
    echo "## $name: skipped, the time budget is spent" | tee -a "$OUT/skipped.txt"
    return 124
  fi
  # -k: SIGTERM only asks a run to stop after its step (train_ddp's stop request), and pytest running the
  # CLI in-process takes it that way too; the KILL 10 s later keeps the budget a bound
  timeout -k 10 "$max" "$@"
}

# sanitize TOOL MAX_SECONDS: compute-sanitizer TOOL (memcheck, racecheck) over the op tests, fp32 and the
# bf16 scalar paths, as a step; its log in $OUT/sanitizer_TOOL.txt, its tail printed. Exit 127 where the
# machine has no compute-sanitizer.
sanitize() {
  local tool=$1 max=$2 rc
  echo "## compute-sanitizer $tool"
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not on this machine" | tee "$OUT/sanitizer_$tool.txt"
    return 127
  fi
  step "compute-sanitizer $tool" "$max" compute-sanitizer --tool "$tool" --error-exitcode 9 $PY -m pytest -q -x -o addopts= \
    tests/test_cuda_ops.py tests/test_cuda_bf16.py -m "not training" -k "not tiny_model and not B4-T64" \
    > "$OUT/sanitizer_$tool.txt" 2>&1
  rc=$?
  tail -n 5 "$OUT/sanitizer_$tool.txt"
  return $rc
}

# pack_results KEEP...: where PACK_RESULTS=1 (the GPU runs in docs/gpu_session.md set it), put every
# file under $OUT into $OUT/results.tar.gz and leave beside it only the KEEP files (the summaries): a
# few files are easier to copy off a GPU machine than the 20 or more a run writes. Elsewhere (CI's simulator runs
# of these scripts) the files stay as they are.
pack_results() {
  [ "${PACK_RESULTS:-}" = 1 ] || return 0
  local keep name
  (cd "$OUT" && find . -type f ! -name results.tar.gz -print0 | sort -z | tar -czf results.tar.gz --null -T -) || return 1
  while IFS= read -r -d '' name; do
    keep=0
    for k in "$@"; do [ "$name" = "./$k" ] && keep=1; done
    [ $keep = 1 ] || rm -f "$OUT/$name"
  done < <(cd "$OUT" && find . -type f ! -name results.tar.gz -print0)
  find "$OUT" -mindepth 1 -type d -empty -delete
}

# require_gpu: end the script at once (exit 2, CuPy's own words) where CuPy sees no GPU; without one every
# step would fail slowly, one timeout after another. Needs $PY and $OUT.
require_gpu() {
  if ! $PY -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" > "$OUT/no_gpu.txt" 2>&1; then
    # the script named by its path below bin/ (gpu_session/cuda.sh): "cuda.sh" alone would not say which
    echo "${0##*bin/}: no GPU that CuPy can use: $(tail -n 1 "$OUT/no_gpu.txt")" >&2
    exit 2
  fi
  rm -f "$OUT/no_gpu.txt"
}

# ensure_crt_headers: CuPy compiles kernels/ against the CUDA headers it finds, on a pip install those of
# the nvidia-cuda-runtime wheel, which has mma.h but not the crt/mma.h it includes (that is the
# nvidia-cuda-crt wheel): without it flash_attention.cu does not compile. Where no include directory of
# CuPy's has it, install the nvidia-cuda-crt wheel in .whl/crt of the runtime's major.minor (.whl/crt/, see
# docs/gpu_session.md) beside the runtime's headers. Says what it found or did in $OUT/crt.txt. The
# simulator compiles with g++ and needs no CUDA headers. Needs $PY and $OUT.
ensure_crt_headers() {
  if [ "${XTRAIN_CUDASIM:-}" = 1 ]; then
    echo "not checked: the CPU simulator compiles kernels/ with g++" > "$OUT/crt.txt"
    return 0
  fi
  local probe="import os, sys
from cupy._core import core
dirs = [o[2:] for o in core.assemble_cupy_compiler_options(()) if o.startswith('-I')]
found = [d for d in dirs if os.path.isfile(os.path.join(d, 'crt', 'mma.h'))]
print('crt/mma.h found in ' + found[0] if found else 'crt/mma.h is in none of CuPy include directories: ' + ' '.join(dirs))
sys.exit(0 if found else 1)"
  $PY -c "$probe" > "$OUT/crt.txt" 2>&1 && return 0
  local version wheel
  version=$($PY -m pip show nvidia-cuda-runtime 2>/dev/null | sed -n 's/^Version: //p')
  wheel=$(ls .whl/crt/nvidia_cuda_crt-"${version%.*}".*.whl 2>/dev/null | tail -n 1)
  if [ -n "$version" ] && [ -n "$wheel" ] \
      && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$wheel" >> "$OUT/crt.txt" 2>&1 \
      && $PY -c "$probe" >> "$OUT/crt.txt" 2>&1; then
    echo "installed $(basename "$wheel") beside nvidia-cuda-runtime $version" >> "$OUT/crt.txt"
  else
    echo "not fixed (nvidia-cuda-runtime ${version:-not installed}, wheel ${wheel:-none in .whl/crt}): the flash" \
      "attention tests will fail to compile" >> "$OUT/crt.txt"
  fi
}
