#!/usr/bin/env bash
# Everything the CUDA backend needs a GPU for, in ONE device call; results land in $OUT for bench/results/.
#
# Device call: command "bash bin/gpu_session_cuda.sh", timeout_s 600 (no wheels to carry: the image
# has CuPy and torch). The benchmark is a separate call: "python3 bin/bench_gpu --out $OUT ..." (see
# bin/bench_gpu's docstring; torch.compile makes the full sweep longer than one call).
#
# What it does, each step recorded even when an earlier one failed:
#   1. device, driver, versions
#   2. the kernels compile (nvcc, NVRTC) and every op against numpy, 2 virtual ranks vs 1 vs numpy,
#      bitwise reruns, the CLI trains with a falling loss: tests/test_kernels_compile.py, test_cuda_ops.py
#   3. compute-sanitizer memcheck and racecheck over the op tests (where the image has it)
#   4. the per-op error table at GPT-2 124M shapes (bin/kernel_errors), fp32 and tf32
#   5. the shipped corpus on the GPU: mini, 200 steps, numpy vs cuda vs cuda with 2 virtual ranks
#   6. $OUT/cuda_results.md: device, commands, test summary, error table, loss curves side by side
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_session_cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3

{
  echo "## device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "## date"; date -u +%Y-%m-%dT%H:%MZ
  echo "## versions"
  $PY -m pip list 2>/dev/null | grep -i -E "^(cupy|cupy-cuda13x|cuda-core|cuda-bindings|numpy|torch|tokenizers) " || true
  nvcc --version 2>/dev/null | tail -1
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

echo "## tests"
timeout 300 $PY -m pytest -q -rs tests/test_kernels_compile.py tests/test_cuda_ops.py 2>&1 | tee "$OUT/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}

sanitizer_rc=0
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    echo "## compute-sanitizer $tool"
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $PY -m pytest -q -x tests/test_cuda_ops.py \
      -k "not tiny_model and not ddp and not reproducible and not command_line" > "$OUT/sanitizer_$tool.txt" 2>&1
    rc=$?; tail -n 5 "$OUT/sanitizer_$tool.txt"; [ $rc -ne 0 ] && sanitizer_rc=$rc
  done
else
  echo "compute-sanitizer not on this image" | tee "$OUT/sanitizer_memcheck.txt"
fi

echo "## per-op errors"
errors_rc=0
timeout 120 $PY bin/kernel_errors --json "$OUT/kernel_errors.json" --markdown "$OUT/kernel_errors.md" || errors_rc=$?
timeout 120 $PY bin/kernel_errors --tf32 --json "$OUT/kernel_errors_tf32.json" --markdown "$OUT/kernel_errors_tf32.md" \
  || errors_rc=$?

echo "## the shipped corpus: numpy vs cuda"
curves_rc=0
for run in "numpy 1" "cuda 1" "cuda 2"; do
  set -- $run
  timeout 150 $PY -m xtrain_dist.train_ddp 200 8 128 --model mini --backend "$1" --world-size "$2" --log-every 50 \
    --report "$OUT/curve_$1_w$2.json" || curves_rc=$?
done

$PY - "$OUT" "$tests_rc" "$sanitizer_rc" "$errors_rc" "$curves_rc" <<'EOF'
import json, pathlib, sys
out, *rcs = pathlib.Path(sys.argv[1]), *map(int, sys.argv[2:])
tests_rc, sanitizer_rc, errors_rc, curves_rc = rcs
env = (out / "environment.txt").read_text().strip()
summary = [l for l in (out / "pytest_cuda.txt").read_text().splitlines()
           if " passed" in l or " failed" in l or l.startswith(("SKIPPED", "FAILED", "ERROR"))]
lines = ["# CUDA backend: GPU session", "", "```", env, "```", "",
         "Command: `bash bin/gpu_session_cuda.sh` (tests: `python3 -m pytest -q -rs tests/test_kernels_compile.py "
         "tests/test_cuda_ops.py`; errors: `bin/kernel_errors [--tf32]`; curves: `python3 -m xtrain_dist.train_ddp "
         "200 8 128 --model mini --backend numpy|cuda --world-size 1|2`).", "",
         f"- tests: exit {tests_rc}", *[f"  - {l}" for l in summary],
         f"- compute-sanitizer memcheck + racecheck: exit {sanitizer_rc}", f"- kernel_errors: exit {errors_rc}",
         f"- curves: exit {curves_rc}", ""]
for name in ("kernel_errors.md", "kernel_errors_tf32.md"):
    if (out / name).exists():
        lines += [(out / name).read_text(), ""]
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("curve_*.json"))}
if runs:
    names = list(runs)
    lines += ["Loss, mini, 200 steps of 8 x 128 tokens, seed 1337:", "",
              "| step | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
    for i in (0, 49, 99, 149, 199):
        lines.append(f"| {i + 1} | " + " | ".join(f"{runs[n]['losses'][i]:.4f}" for n in names) + " |")
    lines += ["", "| run | ms/step | tokens/s | param_sha256 (rank 0) | ranks equal |", "| --- | ---: | ---: | --- | --- |"]
    for n, r in runs.items():
        lines.append(f"| {n} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.0f} | {r['param_sha256'][0][:16]} | "
                     f"{len(set(r['param_sha256'])) == 1} |")
(out / "cuda_results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit $(( tests_rc || sanitizer_rc || errors_rc || curves_rc ))
