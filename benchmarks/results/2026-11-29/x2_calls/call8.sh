#!/bin/bash
# call 8 (x2; call 7's plan on the two GPUs lent today): issue 34's Ulysses exchanges hidden behind the projections
# (one attention call per layer), through peer memory and through NCCL, against NCCL's exchange in one chunk (the
# default). GPUs 0,1: the GPU tests of the peer all-to-all, the pipelined exchange and the overlapped projections,
# then Ulysses S = 2 at 32768 three ways; then GPU 0 the one-GPU reference at 49152 beside GPU 1 the 6.7B under
# ZeRO-3 with CPU offload, capped at 80000 MiB (its memory line after set-up tells the set-up's peak from the
# training's). Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6 ITERS_OFFLOAD=6
stamp start
prepare_machine  # installs the wheels, prepares the data
(CUDA_VISIBLE_DEVICES=0,1 timeout 120 python3 -m pytest -q -rfs -k "peer_all_to_all or two_gpus" \
     tests/core/tensor_parallel/test_async_tp.py tests/core/models/gpt/test_ulysses.py \
     tests/core/models/gpt/test_ulysses_projections.py > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 trainer 0,1 1 ulysses_s2_32k ulysses_s2_32k_proj_peer ulysses_s2_32k_proj
 stamp ulysses_s2
 (trainer 0 2 ulysses_1gpu_48k; stamp ulysses_1gpu) &
 (trainer 1 3 zero3_offload_6p7b@h100; stamp offload) &
 wait) &
wait_for_lanes 565
RUNS="ulysses_compare zero3_offload_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
