#!/bin/bash
# call 15 (one H200, 128 GiB of host memory): ZeRO-3 with parameters and optimizer on the CPU after the loader's
# workers start from a fork server (f7bc14a) and the linear layers save a released weight itself: the 2.7B (call 11
# before the fork server: 99.2 GB host as a sum of resident sizes), then the 6.7B (223 GB that way, on the x4 machine;
# its model states need about 120 GB: whether it now trains on a host of 128 GiB), both capped at 80000 MiB on the
# GPU, 5 iterations. The host figure is now the run's proportional set sizes (tools/benchmarks/host_memory.py).
# The 2.7B's results are tarred into $OUT/early.tgz before the 6.7B starts; everything into $OUT/runs.tgz
source tests/gpu/device_call.sh
export ITERS_OFFLOAD=5
stamp start
prepare_machine  # installs the wheels, prepares the data
free -m > $OUT/free_at_start.txt
(trainer 0 1 zero3_offload_2p7b@h100; stamp 2p7b
 tar czf $RESULTS/early.tgz -C $OUT .
 trainer 0 2 zero3_offload_6p7b@h100; stamp 6p7b) &
wait_for_lanes 540
RUNS="zero3_offload_compare" LANE=6 timeout 15 bash tests/gpu/run_trainer.sh > $OUT/compare.log 2>&1
