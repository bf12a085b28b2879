#!/bin/bash
# call 9 (x2): where the time of Ulysses S = 2 at 32768 goes with the exchanges beside the projections through peer
# memory (call 8's fastest: a profile of iteration 3 on GPUs 0,1); then GPU 0 one GPU at 57344 (does it fit, and
# how fast: the reference is the longest sequence that fits) beside GPU 1 the 6.7B under ZeRO-3 with CPU offload,
# capped at 80000 MiB, recording the allocator's history: what is alive at its peak, by where it was allocated.
# Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6 ITERS_OFFLOAD=2
stamp start
prepare_machine  # installs the wheels, prepares the data
(trainer 0,1 1 profile_ulysses_s2_32k_proj_peer
 stamp profile
 (summarize profile_ulysses_s2_32k_proj_peer; stamp summarized) &
 (trainer 0 2 ulysses_1gpu_56k; stamp ulysses_1gpu) &
 (GPU_MEMORY_HISTORY=$OUT/zero3_offload_6p7b.memory trainer 1 3 zero3_offload_6p7b@h100; stamp offload) &
 wait) &
wait_for_lanes 480
RUNS="ulysses_compare zero3_offload_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
