#!/usr/bin/env bash
# Everything NCCL, verified in one run of a few minutes on a GPU machine; results land in $OUT for
# bench/results/.
#
# The [cuda] extra installs nccl4py. On a machine without network access whose Python has CuPy, cuda-core,
# cuda-bindings and nvidia-nccl-cu13 but not nccl4py, the script installs its cp312 wheel from .whl/,
# downloaded beforehand on a machine with network access, in the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl nccl4py==0.6.0
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl/fallback \
#       cuda-core==1.2.2 cuda-pathfinder==1.9.0
#
# then on the GPU machine: bash bin/gpu_session/nccl.sh, with the wheels in .whl (10 MB).
# nccl4py 0.6.0 needs cuda-core ~= 1.0 and cuda-pathfinder >= 1.5.4. The installed ones are used when
# nccl4py imports with them (CuPy shares them); only if it does not are the fallback wheels put first.
#
# What it does, each step recorded even when an earlier one failed:
#   1. device, driver, versions of CuPy / cuda-core / nccl4py / libnccl
#   2. tests/test_nccl.py: world 1 bits, bf16, streams, rank threads (>= 2 GPUs), world-1 training over
#      NCCL vs the in-process communicator (when the CUDA backend is in the tree), and two processes on
#      one GPU with distinct NCCL_HOSTID: probe first, then fp32/bf16 collectives, DDP vs world 1, kill
#   3. the NCCL_HOSTID probe on its own, its output kept whole
#   4. an all-reduce bus-bandwidth sweep (4 KiB .. 256 MiB, fp32) between the two NCCL_HOSTID
#      processes (NCCL's socket transport over loopback, not NVLink: a check of the path, not of the GPU)
#   5. $OUT/nccl_results.md: device, commands, test summary, probe verdict, bandwidth table
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_session_nccl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}  # the python that runs every step (the tests set their own)

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ! $PY -c "import nccl.core" 2>/dev/null && ls .whl/fallback/*.whl >/dev/null 2>&1; then
  echo "nccl4py does not import with the installed cuda-core/cuda-pathfinder: using the ones in .whl/fallback"
  $PY -c "import nccl.core" 2>&1 | tail -n 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-first \
    .whl/fallback/*.whl && export PYTHONPATH="/tmp/site-first:$PYTHONPATH"
fi

. bin/gpu_session/common.sh
require_gpu

{
  echo "## device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "## versions"
  $PY -m pip list 2>/dev/null | grep -i -E "^(cupy|cuda-core|cuda-bindings|nvidia-nccl|numpy|tokenizers) " || true
  $PY -c "import nccl.core as n; n.show_versions()" 2>&1
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

echo "## tests/test_nccl.py"
$PY -m pytest -q -rs -s -o addopts= tests/test_nccl.py 2>&1 | tee "$OUT/pytest_nccl.txt"
tests_rc=${PIPESTATUS[0]}

port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

two_procs() {  # two processes on GPU 0, two "hosts" for NCCL
  local p pids=() rc=0; p=$(port)
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p NCCL_HOSTID=xtrain-host-$r \
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout -k 10 300 $PY tests/nccl_worker.py "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  return $rc
}

echo "## NCCL_HOSTID probe"
NCCL_DEBUG=INFO two_procs probe > "$OUT/hostid_probe.txt" 2>&1
probe_rc=$?
tail -n 30 "$OUT/hostid_probe.txt"

echo "## all-reduce bus bandwidth, 2 processes x 1 GPU (NCCL_HOSTID)"
bench_rc=1
if [ $probe_rc -eq 0 ]; then
  two_procs bench 256 > "$OUT/bench_raw.txt" 2>&1
  bench_rc=$?
fi

$PY - "$OUT" "$tests_rc" "$probe_rc" "$bench_rc" <<'EOF'
import json, pathlib, sys
out, tests_rc, probe_rc, bench_rc = pathlib.Path(sys.argv[1]), *map(int, sys.argv[2:])
env = (out / "environment.txt").read_text()
summary = [l for l in (out / "pytest_nccl.txt").read_text().splitlines() if " passed" in l or " failed" in l
           or "skipped" in l or l.startswith("SKIPPED")]
lines = ["# NCCL through nccl4py on a GPU", "", "```", env.strip(), "```", "",
         "Commands: `bash bin/gpu_session/nccl.sh` (tests: `python3 -m pytest -q -rs -s tests/test_nccl.py`; "
         "probe: two `tests/nccl_worker.py probe` processes with NCCL_HOSTID=xtrain-host-0/1 on GPU 0; "
         "bench: the same with `bench 256`).", "",
         f"- tests/test_nccl.py: exit {tests_rc}", *[f"  - {l}" for l in summary],
         f"- two processes on one GPU with distinct NCCL_HOSTID: {'works' if probe_rc == 0 else 'FAILED'} "
         f"(exit {probe_rc}; NCCL's log in hostid_probe.txt)", ""]
bench = None
raw = out / "bench_raw.txt"
if raw.exists():
    for l in raw.read_text().splitlines():
        if l.startswith("BENCH "):
            bench = json.loads(l[6:])
if bench:
    (out / "nccl_bench.json").write_text(json.dumps(bench, indent=1) + "\n")
    lines += [f"All-reduce, fp32, world {bench['world']} (2 processes on 1 GPU, NCCL socket transport):", "",
              "| bytes | time (us) | algbw (GB/s) | busbw (GB/s) |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['bytes']} | {r['us']:.1f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} |" for r in bench["rows"]]
else:
    lines.append(f"No bandwidth table (bench exit {bench_rc}; see bench_raw.txt).")
(out / "nccl_results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
pack_results nccl_results.md pytest_nccl.txt
exit $(( tests_rc || probe_rc || bench_rc ))
