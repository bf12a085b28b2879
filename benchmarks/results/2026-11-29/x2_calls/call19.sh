#!/bin/bash
# call 19 (one H200): what the 2.7B offload run's host memory beyond its states is (call 17: about 21 GB of its
# 77.4 GB peak): the rank's resident memory by kind and PyTorch's pinned host memory every 5 s
# (HOST_MEMORY_REPORT, tests/gpu/memory_cap), beside the run's whole host memory each second. 3 iterations: the
# first optimizer step makes the peak. Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_OFFLOAD=3
stamp start
prepare_machine  # installs the wheels, prepares the data
(HOST_MEMORY_REPORT=$OUT/zero3_offload_2p7b.host_kinds trainer 0 1 zero3_offload_2p7b@h100; stamp 2p7b) &
wait_for_lanes 200
