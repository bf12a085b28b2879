#!/bin/bash
# call 16 (one H200): ZeRO-3 offload's host memory before and after the CPU optimizer's fp32 gradients became views
# of DeepSpeed's accumulation buffer (5b81472), the 2.7B capped at 80000 MiB, 5 iterations each: first from this
# tree, then from the tree of 41fb821 in ./before (the same run without the sharing), one after the other on the
# same GPU. Everything tarred into $OUT/runs.tgz (the runs before the change under before/)
source tests/gpu/device_call.sh
export ITERS_OFFLOAD=5
stamp start
prepare_machine  # installs the wheels, prepares the data
(trainer 0 1 zero3_offload_2p7b@h100; stamp after
 mkdir -p $OUT/before
 (cd before && PYTHONPATH=/tmp/site:$PWD OUT=$OUT/before GPU_IDS=0 MASTER_PORT=29531 LANE=2 RUNS="zero3_offload_2p7b@h100 zero3_offload_compare" \
      bash tests/gpu/run_trainer.sh >> $OUT/before/lane2.log 2>&1); stamp before) &
wait_for_lanes 500
RUNS="zero3_offload_compare" LANE=6 timeout 15 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
