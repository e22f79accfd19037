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

# ensure_crt_headers: CuPy compiles kernels/ against the CUDA headers it finds, on a pip install those of
# the nvidia-cuda-runtime wheel, which has mma.h but not the crt/mma.h it includes (that is the
# nvidia-cuda-crt wheel): without it flash_attention.cu does not compile. Where no include directory of
# CuPy's has it, install the carried nvidia-cuda-crt wheel of the runtime's major.minor (.whl/crt/, see
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
    echo "not fixed (nvidia-cuda-runtime ${version:-not installed}, wheel ${wheel:-not carried}): the flash" \
      "attention tests will fail to compile" >> "$OUT/crt.txt"
  fi
}
