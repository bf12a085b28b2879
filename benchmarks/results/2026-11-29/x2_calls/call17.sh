#!/bin/bash
# call 17 (one H200): when the 2.7B's host peak under ZeRO-3 with both offloads comes (call 16: 77.4 GB with and
# without the shared gradient partitions, ~19 GB above its 22 bytes per parameter): the run's host memory every
# second with the time of day (zero3_offload_2p7b.host_readings) beside its log's timestamped lines (set-up, model
# and optimizer built, training done). Everything tarred into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_OFFLOAD=3
stamp start
prepare_machine  # installs the wheels, prepares the data
(trainer 0 1 zero3_offload_2p7b@h100; stamp 2p7b) &
wait_for_lanes 300
