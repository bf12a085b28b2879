#!/usr/bin/env bash
# Fused kernels on a GPU machine: the tests (Triton vs reference, fp16/bf16/fp32, forward and
# backward) and the benchmark table (max errors, speed-ups). Run from the repository root; logs go
# to $OUT (default /tmp/fused_kernels). Extra arguments go to the benchmark (e.g. --compile).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fused_kernels}
mkdir -p "$OUT"
status=0
python3 -m pytest -q -rf tests/core/fused_kernels 2>&1 | tee "$OUT/fused_kernels_test.log" || status=1
python3 tools/benchmarks/bench_fused_kernels.py "$@" 2>&1 | tee "$OUT/fused_kernels_bench.log" || status=1
exit $status
