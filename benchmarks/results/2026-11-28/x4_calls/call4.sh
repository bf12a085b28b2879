#!/bin/bash
# call 4 (x4): FP8 after the delayed-scaling fix. GPU 0: the FP8 GPU tests, then the 1.3B bf16/FP8 runs at
# micro-batch 16 and a profile of FP8 delayed; GPUs 1,2: the overlapped FP8 test, then the 6.7B at TP = 2;
# GPU 3: the four loss-parity runs at once. Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export PARITY_ITERS=2000
stamp start
(LANES="3=fp8_parity_side_by_side" RUNS=fp8_parity_compare bash tests/gpu/run_trainer.sh > $OUT/parity_driver.log 2>&1
 stamp parity) &
while [ ! -f /tmp/gpu_trainer_work/data/python-docs_text_document.idx ]; do sleep 2; done
sleep 5
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
(CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m pytest -q -rfs -m gpu tests/core/fused_kernels/test_fp8_ops.py \
     tests/core/tensor_parallel/test_fp8_gpu.py > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 GPU_IDS=0 MASTER_PORT=29561 LANE=6 RUNS="fp8_1p3b_bf16_mbs16 fp8_1p3b_delayed_mbs16 fp8_1p3b_tensorwise_mbs16 fp8_1p3b_compare fp8_1p3b_rowwise_mbs16 fp8_1p3b_compare profile_fp8_1p3b" \
     bash tests/gpu/run_trainer.sh > $OUT/lane0.log 2>&1
 stamp lane0
 summarize profile_fp8_1p3b
 stamp summary) &
(CUDA_VISIBLE_DEVICES=1,2 timeout 90 python3 -m pytest -q -rfs -m gpu tests/core/tensor_parallel/test_async_tp.py \
     > $OUT/gpu_tests_tp2.log 2>&1
 stamp gpu_tests_tp2
 GPU_IDS=1,2 MASTER_PORT=29531 LANE=7 RUNS="fp8_6p7b_tp2_bf16-overlap_mbs4 fp8_6p7b_tp2_delayed-overlap_mbs8 fp8_6p7b_compare fp8_6p7b_tp2_delayed-overlap_mbs4 fp8_6p7b_tp2_bf16-overlap_mbs8 fp8_6p7b_compare" \
     bash tests/gpu/run_trainer.sh > $OUT/lane12.log 2>&1
 stamp lane12) &
wait_for_lanes 550
[ -f $OUT/fp8_parity.txt ] || (timeout 20 python3 tests/gpu/fp8_parity.py $OUT/fp8_parity_bf16.log $OUT/fp8_parity_delayed.log \
    $OUT/fp8_parity_tensorwise.log $OUT/fp8_parity_rowwise.log > $OUT/fp8_parity_partial.txt 2>&1)
