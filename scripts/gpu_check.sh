#!/usr/bin/env bash
# The GPU checks (issue 27) on a lent GPU machine: the GPU backend's tests on CUDA tensors, then
# bench/bench_gpu.py. That machine has its own torch and no network, so the operator library comes
# from scripts/build_device_ops.sh (built here against its torch version, in .device/) and
# optional wheels (Liger) from .whl/. Results and logs go to $OUT (default runs/gpu-check).
# Usage: scripts/gpu_check.sh [tests|bench|all] [extra bench_gpu.py arguments...]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-all}
shift || true
out=${OUT:-$root/runs/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/relpos-site "$root"/.whl/*.whl && export PYTHONPATH=/tmp/relpos-site
fi
if [ -f "$root/.device/_relpos_ops.so" ]; then
  export RELPOS_OPS_LIBRARY=$root/.device/_relpos_ops.so
  export LD_LIBRARY_PATH=$root/.device/lib:${LD_LIBRARY_PATH:-}
fi
export PYTHONPATH=$root/python:$root/tests/python:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi -L
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  SECONDS=0
  # Triton compiles each kernel variant on first use: spread the files over processes
  par=()
  "$py" -c 'import xdist' 2>/dev/null && par=(-n "${GPU_TEST_PROCS:-8}")
  "$py" -m pytest "$root/tests/python/gpu" -q -p no:cacheprovider -rfE --durations=15 "${par[@]}" \
    2>&1 | tee "$out/gpu_tests.log" || rc=1
  echo "== GPU tests: ${SECONDS}s"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  SECONDS=0
  "$py" "$root/bench/bench_gpu.py" --out "$out" "$@" 2>&1 | tee "$out/bench_gpu.log" || rc=1
  echo "== GPU bench: ${SECONDS}s"
fi
exit $rc
