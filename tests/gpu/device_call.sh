#!/bin/bash
# The shared part of a device call's script (a call of the device machine runs one command, at most 10 minutes,
# and only 8 files come back). Source it from the repository root: `source tests/gpu/device_call.sh`. It sends
# every output to /tmp/runs and, on exit, tars that into $OUT/runs.tgz beside timeline.txt (what each lane
# stamped, in seconds from the start), and records the GPUs in device.txt. Then:
#   prepare_machine              install the carried wheels and prepare the data (tests/gpu/run_trainer.sh)
#   trainer GPUS LANE RUNS...    tests/gpu/run_trainer.sh's RUNS on GPUS with lane LANE's port and data cache
#   summarize RUN                the tables of a profiled run's trace (tools/benchmarks/trace_summary.py)
#   wait_for_lanes SECONDS       wait for the background lanes until SECONDS after the start ($deadline),
#                                then stop what is left
set -o pipefail
RESULTS=$OUT
export OUT=/tmp/runs
mkdir -p $OUT
T0=$(date +%s)
stamp() { echo "$(($(date +%s) - T0)) s: $*" >> $OUT/timeline.txt; }
finish() { stamp finish; tar czf $RESULTS/runs.tgz --exclude='*.pt.trace.json' -C $OUT . ; cp $OUT/timeline.txt $RESULTS/; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/device.txt

prepare_machine() {
    RUNS=" " bash tests/gpu/run_trainer.sh > $OUT/prepare.log 2>&1
    stamp prepared
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
}

trainer() {  # gpus lane runs...
    local gpus=$1 lane=$2
    shift 2
    GPU_IDS=$gpus MASTER_PORT=$((29511 + 10 * lane)) LANE=$lane RUNS="$*" bash tests/gpu/run_trainer.sh >> $OUT/lane$lane.log 2>&1
}

summarize() {  # run: its trace's tables
    local trace
    trace=$(ls $OUT/$1/*.pt.trace.json 2>/dev/null | head -n 1)
    [ -n "$trace" ] || return
    timeout 60 python3 tools/benchmarks/trace_summary.py "$trace" > $OUT/$1_summary.md 2>&1
    timeout 60 python3 tools/benchmarks/trace_summary.py --by-operator "$trace" > $OUT/$1_by_operator.md 2>&1
    timeout 60 python3 tools/benchmarks/trace_summary.py --idle "$trace" > $OUT/$1_idle.md 2>&1
    timeout 60 python3 tools/benchmarks/trace_summary.py --exposed "$trace" > $OUT/$1_exposed.md 2>&1
}

wait_for_lanes() {  # seconds
    deadline=$((T0 + $1))
    while [ -n "$(jobs -rp)" ] && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
    stamp "lanes done or deadline"
    kill $(jobs -rp) 2>/dev/null
}
