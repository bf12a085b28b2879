#!/bin/bash
# call 6 (x4): issue 34's remaining figures. GPU 0: selective recompute on an "80 GB H100" (the allocator capped), then
# Ulysses' one-GPU reference at 49152; GPU 1: ZeRO-3 with CPU offload of the 6.7B, then one GPU at 32768; GPUs 2,3:
# Ulysses S = 2 with 1, 2 and 4 chunks, then ZeRO-1 against ZeRO-3 at micro-batch 32; then, if the time allows,
# Ulysses S = 4 at 65536 on the four GPUs. Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6 ITERS_OFFLOAD=6
stamp start
prepare_machine  # installs the wheels, prepares the data
(ITERS=16 LOG_INTERVAL=2 trainer 0 1 1p3b_bf16@h100 1p3b_mbs16_mlp_act_block6@h100 1p3b_mbs16_mlp_act_block8@h100 \
     1p3b_mbs16_mlp_act@h100
 stamp recompute
 trainer 0 1 ulysses_1gpu_48k
 stamp ulysses_48k) &
(trainer 1 2 zero3_offload_6p7b@h100 zero3_optoffload_6p7b@h100
 stamp offload
 trainer 1 2 ulysses_1gpu_32k
 stamp ulysses_32k) &
(trainer 2,3 3 ulysses_s2_32k_c1 ulysses_s2_32k_c2 ulysses_s2_32k
 stamp ulysses_s2
 trainer 2,3 3 zero1_1p3b_dp2_mbs32 zero3_1p3b_dp2_mbs32
 stamp zero_mbs32) &
wait_for_lanes 560
if [ $(($(date +%s) + 140)) -lt $deadline ]; then
    (trainer 0,1,2,3 4 ulysses_s4_64k_c2; stamp s4) &
    wait_for_lanes 560
fi
RUNS="recompute_compare zero3_offload_compare ulysses_compare zero3_compare" LANE=6 timeout 20 \
    bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
