#!/bin/bash
# call 7 (x4; prepared at 277699b, not yet run): issue 34's Ulysses exchanges hidden behind the projections (one
# attention call per layer) or behind chunks of heads through peer memory, against NCCL's exchange, and where ZeRO-3
# offload's GPU memory goes. GPUs 0,1: the GPU tests of both, then Ulysses S = 2 at 32768 with the default exchange
# (NCCL, one chunk), beside the projections through peer memory and through NCCL, and through peer memory in 2
# chunks of heads; GPU 2: the one-GPU references at 49152 and 32768; GPU 3: the 6.7B under ZeRO-3 with CPU offload,
# capped at 80000 MiB (its memory line after set-up tells the set-up's peak from the training's). Then, if the time
# allows, a profile beside the projections through peer memory, and peer memory in one chunk. Everything tarred into
# $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6 ITERS_OFFLOAD=6
stamp start
prepare_machine  # installs the wheels, prepares the data
(CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -rfs -k "peer_all_to_all or two_gpus" \
     tests/core/tensor_parallel/test_async_tp.py tests/core/models/gpt/test_ulysses.py \
     tests/core/models/gpt/test_ulysses_projections.py > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 trainer 0,1 1 ulysses_s2_32k ulysses_s2_32k_proj_peer ulysses_s2_32k_proj ulysses_s2_32k_c2_peer
 stamp ulysses_s2) &
(trainer 2 2 ulysses_1gpu_48k ulysses_1gpu_32k
 stamp ulysses_1gpu) &
(trainer 3 3 zero3_offload_6p7b@h100
 stamp offload) &
wait_for_lanes 420
if [ $(($(date +%s) + 100)) -lt $((T0 + 560)) ]; then
    (trainer 0,1 4 profile_ulysses_s2_32k_proj_peer; stamp profile) &
    (trainer 2,3 5 ulysses_s2_32k_peer; stamp peer_c1) &
    wait_for_lanes 560
    summarize profile_ulysses_s2_32k_proj_peer
fi
RUNS="ulysses_compare zero3_offload_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
