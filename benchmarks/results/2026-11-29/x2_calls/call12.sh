#!/bin/bash
# call 12 (x2): ZeRO-3 after the parallel linear layers and the output layer save a released weight itself
# (released_after_use), and the pipelined Ulysses exchange (TP > 1 or FP8) under the new default ("auto": peer memory
# within one host) against NCCL. GPUs 0,1: the 1.3B at DP = 2, ZeRO-1 against ZeRO-3 at micro-batch 16 (call 5 before
# the change: 599.94 / 542.46, 74.4 / 70.6 GB); then S = 2 at 32768 pipelined in one chunk, by default and through
# NCCL; then GPU 1 the 6.7B under ZeRO-3 with CPU offload, capped at 80000 MiB, with the allocator's history (call 10
# before the change: peak 23,849 MiB, 12,028 of it gathered weights) and its host memory (x2: 256 GiB).
# Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6 ITERS_OFFLOAD=3
stamp start
prepare_machine  # installs the wheels, prepares the data
(trainer 0,1 1 zero1_1p3b_dp2_mbs16 zero3_1p3b_dp2_mbs16
 stamp zero3_dp2
 trainer 0,1 2 ulysses_s2_32k_c1 ulysses_s2_32k_c1_nccl
 stamp pipelined
 GPU_MEMORY_HISTORY=$OUT/zero3_offload_6p7b.memory trainer 1 3 zero3_offload_6p7b@h100; stamp offload) &
wait_for_lanes 565
RUNS="zero3_compare zero3_offload_compare ulysses_compare" LANE=6 timeout 25 bash tests/gpu/run_trainer.sh \
    > $OUT/compare.log 2>&1
