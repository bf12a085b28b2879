#!/bin/bash
# call 10 (x2): Ulysses S = 2 at 32768 with the exchanges beside the projections, the blocks that stay on a rank
# computed while the others travel (the default since this commit: NCCL's point-to-point transfers), and through
# peer memory, against one GPU at 57344 (call 9: the longest that fits an H200); the GPU tests of both first. Then
# GPU 1 the 6.7B under ZeRO-3 with CPU offload, capped at 80000 MiB, recording the allocator's history (what is
# alive at its peak, by where it was allocated) beside GPU 0's one-GPU run. Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6 ITERS_OFFLOAD=3
stamp start
prepare_machine  # installs the wheels, prepares the data
(CUDA_VISIBLE_DEVICES=0,1 timeout 100 python3 -m pytest -q -rfs -k "peer_all_to_all or two_gpus" \
     tests/core/tensor_parallel/test_async_tp.py tests/core/models/gpt/test_ulysses_projections.py \
     > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 trainer 0,1 1 ulysses_s2_32k ulysses_s2_32k_proj_peer
 stamp ulysses_s2
 (trainer 0 2 ulysses_1gpu_56k; stamp ulysses_1gpu) &
 (GPU_MEMORY_HISTORY=$OUT/zero3_offload_6p7b.memory trainer 1 3 zero3_offload_6p7b@h100; stamp offload) &
 wait) &
wait_for_lanes 545
RUNS="ulysses_compare zero3_offload_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
