#!/bin/bash
# The checkpoint conversions at scale on the GPU machine's CPUs: the 1.3B GPT trained 3 iterations in bf16
# at ZeRO-1 (tests/gpu/run_trainer.sh RUNS=1p3b_checkpoint: weights plus fp32 master weights and Adam
# moments), then our universal conversion, DeepSpeed's own and the transformers export
# (bench_checkpoint_conversion.py: seconds, peak RSS, bytes written). Run from the repository root with
# .whl carried: bash tools/benchmarks/bench_checkpoint_conversion.sh   (WORKERS=4 for 4 processes each)
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_conversion}
WORK=${WORK:-/tmp/gpu_trainer_work}
mkdir -p "$OUT"
RUNS=1p3b_checkpoint OUT=$OUT WORK=$WORK bash tests/gpu/run_trainer.sh > "$OUT/trainer.log" 2>&1 || exit 1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
python3 tools/benchmarks/bench_checkpoint_conversion.py --input_folder "$WORK/checkpoint_1p3b/global_step3" \
    --work_dir "$WORK/conversion" --workers "${WORKERS:-1}" | tee "$OUT/conversion.md"
