#!/bin/bash
# call 14 (x4, if four GPUs are lent): Ulysses at S = 4, the 1.3B at 65536 on four GPUs by default (beside the
# projections, peer memory within the host) and through NCCL, against one GPU at 57344 (the longest on an H200) and at
# 30720 capped at 80000 MiB (an 80 GB H100), both beside each other on GPUs 0 and 1 after the S = 4 runs.
# Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6
stamp start
prepare_machine  # installs the wheels, prepares the data
(trainer 0,1,2,3 1 ulysses_s4_64k ulysses_s4_64k_proj_nccl
 stamp ulysses_s4
 (trainer 0 2 ulysses_1gpu_56k; stamp h200) &
 (trainer 1 3 ulysses_1gpu_30k@h100; stamp h100) &
 wait) &
wait_for_lanes 565
RUNS="ulysses_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
