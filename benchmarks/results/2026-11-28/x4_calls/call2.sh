#!/bin/bash
# call 2 (x4): FP8 loss parity on the four GPUs, then the FP8 --tp-comm-overlap checks and 6.7B pair on 0,1
# beside the ZeRO-1/3 profiles and the 1.3B bf16/FP8 profiles on 2,3; everything tarred into $OUT/runs.tgz
set -o pipefail
RESULTS=$OUT
export OUT=/tmp/runs ITERS=12 LOG_INTERVAL=2
mkdir -p $OUT
T0=$(date +%s)
stamp() { echo "$(($(date +%s) - T0)) s: $*" >> $OUT/timeline.txt; }
finish() { stamp finish; tar czf $RESULTS/runs.tgz --exclude='*.pt.trace.json' -C $OUT . ; cp $OUT/timeline.txt $RESULTS/; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/device.txt
(GPU_MEMORY_MIB=1000 LOCAL_RANK=0 PYTHONPATH=tests/gpu/memory_cap python3 -c "import torch; torch.empty(2**31, dtype=torch.uint8, device='cuda')" 2>&1 | tail -n 1) > $OUT/memory_cap_check.txt
stamp start
RUNS="fp8_parity_side_by_side fp8_parity_compare" timeout 320 bash tests/gpu/run_trainer.sh > $OUT/parity_driver.log 2>&1
stamp parity
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH LANE=9
summarize() {  # run: its trace's tables
    local trace
    trace=$(ls $OUT/$1/*.pt.trace.json 2>/dev/null | head -n 1)
    [ -n "$trace" ] || return
    timeout 60 python3 tools/benchmarks/trace_summary.py "$trace" > $OUT/$1_summary.md 2>&1
    timeout 60 python3 tools/benchmarks/trace_summary.py --by-operator "$trace" > $OUT/$1_by_operator.md 2>&1
    timeout 60 python3 tools/benchmarks/trace_summary.py --idle "$trace" > $OUT/$1_idle.md 2>&1
}
(CUDA_VISIBLE_DEVICES=0,1 timeout 60 python3 -m pytest -q -rfs -m gpu -k "overlapped" tests/core/tensor_parallel/test_async_tp.py > $OUT/gpu_tests.log 2>&1
 stamp gpu_tests
 GPU_IDS=0,1 MASTER_PORT=29531 RUNS="fp8_6p7b_tp2_delayed-overlap_mbs8 fp8_6p7b_tp2_bf16-overlap_mbs4 fp8_6p7b_compare" bash tests/gpu/run_trainer.sh > $OUT/lane_fp8.log 2>&1
 stamp fp8_6p7b) &
(GPU_IDS=2,3 MASTER_PORT=29541 LANE=8 RUNS="profile_zero3_dp2 profile_zero1_dp2" bash tests/gpu/run_trainer.sh > $OUT/lane_zero.log 2>&1
 stamp zero_profiles
 summarize profile_zero3_dp2 & summarize profile_zero1_dp2 &
 GPU_IDS=2 MASTER_PORT=29551 LANE=7 RUNS=profile_fp8_1p3b bash tests/gpu/run_trainer.sh > $OUT/lane_p8.log 2>&1 &
 GPU_IDS=3 MASTER_PORT=29561 LANE=6 RUNS=profile_bf16_1p3b bash tests/gpu/run_trainer.sh > $OUT/lane_p16.log 2>&1 &
 wait
 stamp fp8_profiles
 summarize profile_fp8_1p3b & summarize profile_bf16_1p3b & wait
 stamp summaries) &
deadline=$((T0 + 550))
while [ -n "$(jobs -rp)" ] && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
stamp "lanes done or deadline"
kill $(jobs -rp) 2>/dev/null
