# Sourced by bin/gpu_session_cuda.sh and bin/gpu_session_nccl.sh: what both need before their first step.

# require_gpu: end the script at once (exit 2, CuPy's own words) where CuPy sees no GPU; without one every
# step would fail slowly, one timeout after another. Needs $PY and $OUT.
require_gpu() {
  if ! $PY -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" > "$OUT/no_gpu.txt" 2>&1; then
    echo "$(basename "$0"): no GPU that CuPy can use: $(tail -n 1 "$OUT/no_gpu.txt")" >&2
    exit 2
  fi
  rm -f "$OUT/no_gpu.txt"
}
