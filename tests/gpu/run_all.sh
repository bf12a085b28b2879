#!/bin/bash
# Every GPU check and benchmark in one go, on the GPU machine, from the repository root:
#   bash tests/gpu/run_all.sh            (logs under $OUT, default /tmp/gpu_checks)
# Carry .whl (made by ../shared/device/prepare-wheels.sh) so DeepSpeed is importable there.
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/device.txt"
python3 -m pytest -q -rfs -m gpu --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu_tests.log" || status=1
python3 tools/benchmarks/bench_fused_kernels.py 2>&1 | tee "$OUT/fused_kernels_bench.log" || status=1
python3 tools/benchmarks/bench_gpt_model.py 2>&1 | tee "$OUT/gpt_1p3b_bench.log" || status=1
exit $status
