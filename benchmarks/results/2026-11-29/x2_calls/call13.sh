#!/bin/bash
# call 13 (x2): the exchange's new default ("auto": peer memory within one host) on its GPU tests, then Ulysses'
# 90 % goal against both readings of "the longest sequence that fits one GPU": an H200 (57344, call 9) and an 80 GB
# H100 (the allocator capped at 80000 MiB: 32768 wanted 81.0 GiB in calls 1-6, so 30720 or 28672 is the longest).
# GPUs 0,1: S = 2 at 32768 by default and through NCCL (ulysses_s2_32k_mbs2, micro-batch 2, left for a call with
# more device time); then GPU 0 one GPU at 30720 and 28672 capped beside GPU 1 one GPU at 57344; then a profile of
# the default run with its exposed communication by the work that waited, and cuDNN's attention alone at the rank's
# shape on the same GPU (call 18: the one-GPU reference's attention runs at its speed alone). Everything tarred
# into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_ULYSSES=6
stamp start
prepare_machine  # installs the wheels, prepares the data
(CUDA_VISIBLE_DEVICES=0,1 timeout 60 python3 -m pytest -q -rfs -k "two_gpus and auto" \
     tests/core/models/gpt/test_ulysses_projections.py > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 trainer 0,1 1 ulysses_s2_32k ulysses_s2_32k_proj_nccl
 stamp ulysses_s2
 (trainer 0 2 ulysses_1gpu_30k@h100 ulysses_1gpu_28k@h100; stamp h100) &
 (trainer 1 3 ulysses_1gpu_56k; stamp h200) &
 wait
 trainer 0,1 4 profile_ulysses_s2_32k_proj
 stamp profile
 summarize profile_ulysses_s2_32k_proj
 timeout 40 python3 tools/benchmarks/bench_attention_shapes.py 8:32768 > $OUT/attention_shapes.txt 2>&1) &
wait_for_lanes 505
RUNS="ulysses_compare" LANE=6 timeout 20 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
