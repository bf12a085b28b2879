#!/bin/bash
# call 11 (one H200, 128 GiB of host memory: the 6.7B's 223 GB do not fit it): the 2.7B GPT under ZeRO-3 with CPU
# offload, capped at 80000 MiB, recording the allocator's history, after the parallel linear layers save a ZeRO-3
# weight itself for backward (call 10: the views torch's linear saved kept every layer's gathered weights alive
# until backward). Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_OFFLOAD=3
stamp start
prepare_machine  # installs the wheels, prepares the data
(GPU_MEMORY_HISTORY=$OUT/zero3_offload_2p7b.memory trainer 0 3 zero3_offload_2p7b@h100; stamp offload) &
wait_for_lanes 215
RUNS="zero3_offload_compare" LANE=6 timeout 15 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
