#!/bin/bash
# call 18 (one H200): is the attention of the Ulysses run slower than the same kernels alone more than the reference's
# is? In call 9's profile of S = 2 at 32768 cuDNN's attention took 3.78 ms forward and 10.79 backward per layer and
# micro-batch, against 3.40 and 9.87 alone (an isolated probe). Here: a profile of the one-GPU
# reference at 57344 (iteration 4), then the attention alone at both shapes and at 30720
# (tools/benchmarks/bench_attention_shapes.py). Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
stamp start
prepare_machine  # installs the wheels, prepares the data
(trainer 0 1 profile_ulysses_1gpu_56k
 stamp profile
 summarize profile_ulysses_1gpu_56k
 stamp summarized
 timeout 60 python3 tools/benchmarks/bench_attention_shapes.py > $OUT/attention_shapes.txt 2>&1
 stamp attention) &
wait_for_lanes 300
