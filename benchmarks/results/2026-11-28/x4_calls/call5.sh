#!/bin/bash
# call 5 (x4): FP8 on the 6.7B at TP = 2 at global batch 64, and issue 34 after the ZeRO-3 leaf layers (a8bfb55) and
# the pipelined Ulysses exchange (d2a83b1). GPUs 0,1: the 6.7B bf16/FP8 pairs at micro-batch 8 and 16, then ZeRO-1
# against ZeRO-3 at DP = 2 (micro-batch 8). GPUs 2,3: Ulysses S = 2 at 32768 and its profile, one GPU at 49152 and at
# 32768 side by side, then ZeRO-1 against ZeRO-3 at micro-batch 16. Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6
stamp start
prepare_machine  # installs the wheels, prepares the data
(ITERS_FP8=8 trainer 0,1 1 fp8_6p7b_tp2_bf16-overlap_mbs8_gbs64 fp8_6p7b_tp2_delayed-overlap_mbs8_gbs64 \
     fp8_6p7b_tp2_bf16-overlap_mbs16_gbs64 fp8_6p7b_tp2_delayed-overlap_mbs16_gbs64 fp8_6p7b_compare
 stamp fp8_6p7b
 trainer 0,1 1 zero1_1p3b_dp2 zero3_1p3b_dp2
 stamp zero_mbs8) &
(trainer 2,3 2 ulysses_s2_32k profile_ulysses_s2_32k
 stamp ulysses_s2
 summarize profile_ulysses_s2_32k &
 trainer 2 3 ulysses_1gpu_48k &
 trainer 3 4 ulysses_1gpu_32k &
 wait
 stamp ulysses_1gpu
 trainer 2,3 2 zero1_1p3b_dp2_mbs16 zero3_1p3b_dp2_mbs16
 stamp zero_mbs16) &
wait_for_lanes 555
RUNS="ulysses_compare zero3_compare fp8_6p7b_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
