#!/bin/bash
# call 3 (x4): the three FP8 parity runs on GPUs 0-2 (bf16's 2000-iteration run of call 2 as the reference:
# the bf16 path is unchanged), beside GPU 3: the FP8 GPU tests, the 1.3B bf16/FP8 pair, Ulysses on one GPU
set -o pipefail
RESULTS=$OUT
export OUT=/tmp/runs PARITY_ITERS=2000 ITERS_ULYSSES=4
mkdir -p $OUT
T0=$(date +%s)
stamp() { echo "$(($(date +%s) - T0)) s: $*" >> $OUT/timeline.txt; }
finish() { stamp finish; tar czf $RESULTS/runs.tgz --exclude='*.pt.trace.json' -C $OUT . ; cp $OUT/timeline.txt $RESULTS/; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/device.txt
cp previous/fp8_parity_bf16.log $OUT/
stamp start
(LANES="0=fp8_parity_delayed;1=fp8_parity_tensorwise;2=fp8_parity_rowwise" RUNS=fp8_parity_compare \
    bash tests/gpu/run_trainer.sh > $OUT/parity_driver.log 2>&1; stamp parity) &
while [ ! -f /tmp/gpu_trainer_work/data/python-docs_text_document.idx ]; do sleep 2; done  # the lanes' parent
sleep 5  # installs the wheels and prepares the data first
(export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
 CUDA_VISIBLE_DEVICES=3 timeout 90 python3 -m pytest -q -rfs -m gpu tests/core/fused_kernels/test_fp8_ops.py \
     tests/core/tensor_parallel/test_fp8_gpu.py > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 GPU_IDS=3 MASTER_PORT=29561 LANE=6 RUNS="fp8_1p3b_bf16_mbs16 fp8_1p3b_delayed_mbs16 fp8_1p3b_compare ulysses_1gpu_32k ulysses_1gpu_48k fp8_1p3b_tensorwise_mbs16 fp8_1p3b_compare" \
     bash tests/gpu/run_trainer.sh > $OUT/lane3.log 2>&1
 stamp lane3) &
deadline=$((T0 + 560))
while [ -n "$(jobs -rp)" ] && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
stamp "done or deadline"
kill $(jobs -rp) 2>/dev/null
[ -f $OUT/fp8_parity.txt ] || (timeout 20 python3 tests/gpu/fp8_parity.py $OUT/fp8_parity_bf16.log $OUT/fp8_parity_delayed.log \
    $OUT/fp8_parity_tensorwise.log $OUT/fp8_parity_rowwise.log > $OUT/fp8_parity_partial.txt 2>&1)
