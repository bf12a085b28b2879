#!/bin/bash
source tests/gpu/device_call.sh
export ITERS_OFFLOAD=3
stamp start
prepare_machine
(PYTHONPATH=$PWD/pinprobe:$PYTHONPATH trainer 0 1 zero3_offload_2p7b; stamp 2p7b) &
wait_for_lanes 200
