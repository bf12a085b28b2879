#!/bin/bash
# Our trainer against the strongest peer on one GPU, in one run: the trainer (deepspeed launcher, bf16,
# ZeRO-1, seq 2048, log interval 1) trains the 1.3B GPT at micro-batch 8 and 16 and the 350M at
# micro-batch 16 and 32 (tests/gpu/run_trainer.sh, RUNS="peer_1p3b peer_1p3b_mbs16 peer_350m
# peer_350m_mbs32"), then tools/benchmarks/bench_vs_peer.py trains transformers' GPT-2 of the same
# shapes under torch.compile (AdamW, bf16 autocast) at its candidate micro-batches and prints our
# best / the peer's best in model TFLOP/s.
# Run from the repository root on the GPU machine (.whl carried): bash tools/benchmarks/bench_vs_peer.sh
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_vs_peer}
mkdir -p "$OUT"
status=0
RUNS="peer_1p3b peer_1p3b_mbs16 peer_350m peer_350m_mbs32" OUT=$OUT bash tests/gpu/run_trainer.sh \
    > "$OUT/trainer.log" 2>&1 || status=1
python3 tools/benchmarks/bench_vs_peer.py --ours "1p3b=$OUT/peer_1p3b.log,$OUT/peer_1p3b_mbs16.log" \
    --ours "350m=$OUT/peer_350m.log,$OUT/peer_350m_mbs32.log" \
    2>&1 | tee "$OUT/vs_peer.txt" || status=1
exit $status
