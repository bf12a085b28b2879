#!/bin/bash
# Scaling of the trainer across the GPUs of one machine: the 1.3B GPT (24 layers, hidden 2048, 16 heads,
# seq 2048, bf16, ZeRO-1, micro-batch 8, global batch 64, CPU initialization so every layout starts
# from the same weights) through the deepspeed launcher on the python-docs corpus of examples/data, at
# 1 GPU, DP=2, TP=2 without and with --sequence-parallel (and with --tp-comm-overlap), PP=2 (8 micro-batches; DeepSpeed's default split and
# --pp-partition-method flops, which gives the head's stage fewer layers), and with 4 GPUs also
# TP=2 x DP=2 (without and with sequence parallelism) and PP=4 (both splits). Prints
#   - the losses and grad norms of the first 5 iterations of every layout against the single GPU
#     (tests/gpu/compare_logs.py, bf16 tolerance 2e-2)
#   - per-GPU model TFLOP/s (mean of the iterations after the 3rd) and the ratio to the single GPU
#     (tools/benchmarks/scaling_table.py), with the pipeline bound of the PP rows
# and writes nvidia-smi dmon's record of the GPUs during the runs to $OUT/dmon.log
# Run from the repository root on the GPU machine (.whl carried): bash tools/benchmarks/bench_scaling.sh
#   LAYOUTS="scale_1gpu scale_tp2_sp" ITERS_SCALE=8 bash tools/benchmarks/bench_scaling.sh   (a subset)
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_scaling}
mkdir -p "$OUT"
gpus=$(nvidia-smi -L | wc -l)
default="scale_1gpu scale_dp2 scale_tp2 scale_tp2_sp scale_tp2_overlap scale_pp2 scale_pp2_flops"
[ "$gpus" -ge 4 ] && default="$default scale_tp2dp2 scale_tp2dp2_sp scale_tp2dp2_overlap scale_pp4 scale_pp4_flops"
LAYOUTS=${LAYOUTS:-$default}
status=0
# clocks, power, temperature and memory traffic of every GPU once a second beside the runs (the same
# layout has moved by several percent between calls: this tells throttling from the rest)
nvidia-smi dmon -s pucm -d 1 -o T > "$OUT/dmon.log" 2>&1 &
monitor=$!
RUNS=$LAYOUTS OUT=$OUT bash tests/gpu/run_trainer.sh > "$OUT/trainer.log" 2>&1 || status=1
kill $monitor 2>/dev/null
logs=() named=()
for run in $LAYOUTS; do
    logs+=("$OUT/$run.log")
    case $run in
        scale_pp2) named+=("pp2:8=$OUT/$run.log") ;;
        scale_pp2_flops) named+=("flops-pp2:8=$OUT/$run.log") ;;
        scale_pp4) named+=("pp4:8=$OUT/$run.log") ;;
        scale_pp4_flops) named+=("flops-pp4:8=$OUT/$run.log") ;;
        *) named+=("${run#scale_}=$OUT/$run.log") ;;
    esac
done
python3 tests/gpu/compare_logs.py layouts --tolerance 2e-2 --first 5 "${logs[@]}" | tee "$OUT/scaling_losses.txt" \
    || status=1
python3 tools/benchmarks/scaling_table.py --skip 3 "${named[@]}" | tee "$OUT/scaling_table.md" || status=1
exit $status
