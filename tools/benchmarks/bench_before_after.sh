#!/bin/bash
# A refactor's same-call figures: the same GPU benchmarks on an earlier tree and on this one, one after
# the other on the same GPU, then side by side.
#   BEFORE=DIR [PARTS="trainer generation"] bash tools/benchmarks/bench_before_after.sh
# DIR holds the earlier tree (e.g. `git archive <commit> | tar -x -C DIR`). Parts:
#   trainer      the 1.3B GPT at micro-batch 8 and the 350M at 32 (run_trainer.sh's peer_1p3b and
#                peer_350m_mbs32: seq 2048, bf16, ZeRO-1, 12 iterations); mean model TFLOP/s after
#                iteration 2
#   generation   bench_text_generation.py at batch 1 and 32 (the 1.3B, 128 + 256 tokens); tokens/s
# Run from the repository root on the GPU machine with .whl carried; logs go to $OUT/{before,after}.
set -o pipefail
cd "$(dirname "$0")/../.."
AFTER=$PWD
BEFORE=$(cd "${BEFORE:?BEFORE=DIR: the earlier tree}" && pwd)
OUT=${OUT:-/tmp/gpu_before_after}
PARTS=${PARTS:-"trainer generation"}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH WORK=${WORK:-/tmp/gpu_before_after_work}
status=0

run_tree() {  # label tree part
    local label=$1 tree=$2 part=$3
    mkdir -p "$OUT/$label"
    if [ "$part" = trainer ]; then
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree RUNS="peer_1p3b peer_350m_mbs32" OUT=$OUT/$label \
            bash tests/gpu/run_trainer.sh > "$OUT/$label/trainer.log" 2>&1) || status=1
    else
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree python3 tools/benchmarks/bench_text_generation.py \
            --batch-sizes 1 32 --no-compiled-transformers --skip-growing-cache \
            > "$OUT/$label/text_generation.log" 2>&1) || status=1
    fi
}

for part in $PARTS; do
    run_tree before "$BEFORE" "$part"
    run_tree after "$AFTER" "$part"
done
PYTHONPATH=$AFTER python3 tools/benchmarks/compare_before_after.py "$OUT/before" "$OUT/after" | tee "$OUT/before_after.md"
exit $status
