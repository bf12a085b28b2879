#!/bin/bash
# Our trainer against the strongest peer on one GPU, in one run: the trainer (deepspeed launcher, bf16,
# ZeRO-1, seq 2048, global batch 32 / 64, log interval 1) trains the 1.3B GPT at micro-batch 8, 16 and
# 32 and the 350M at micro-batch 16 and 32 (tests/gpu/run_trainer.sh, the peer_* runs), and the
# Llama-style 1.2B (seq 4096, vocabulary 128256, global batch 16) at micro-batch 1, 2 and 4 (the
# llama1p2b_* runs), then tools/benchmarks/bench_vs_peer.py trains transformers' GPT-2 /
# LlamaForCausalLM of the same shapes under torch.compile (fused AdamW, bf16 autocast) at its candidate
# micro-batches and prints our best / the peer's best in model TFLOP/s. A micro-batch that does not
# fit in memory drops out on either side.
# Run from the repository root on the GPU machine (.whl carried): bash tools/benchmarks/bench_vs_peer.sh
#   MODELS=1p3b bash tools/benchmarks/bench_vs_peer.sh     (one model: about 8 minutes on an H200)
#   MODELS=llama1p2b PEER_ARGS="--warmup 2 --iters 3" bash tools/benchmarks/bench_vs_peer.sh
#                                                          (PEER_ARGS: more options of bench_vs_peer.py)
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_vs_peer}
MODELS=${MODELS:-"1p3b 350m llama1p2b"}
mkdir -p "$OUT"
status=0
declare -A RUNS_OF=([1p3b]="peer_1p3b peer_1p3b_mbs16 peer_1p3b_mbs32" [350m]="peer_350m peer_350m_mbs32"
                    [llama1p2b]="llama1p2b_mbs1 llama1p2b_mbs2 llama1p2b_mbs4")
ours=()
for model in $MODELS; do
    runs=${RUNS_OF[$model]:?"MODELS: $model is not one of ${!RUNS_OF[*]}"}
    RUNS=$runs OUT=$OUT bash tests/gpu/run_trainer.sh >> "$OUT/trainer.log" 2>&1 || status=1
    logs=$(for run in $runs; do printf '%s,' "$OUT/$run.log"; done)
    ours+=(--ours "$model=${logs%,}")
done
python3 tools/benchmarks/bench_vs_peer.py "${ours[@]}" ${PEER_ARGS:-} 2>&1 | tee "$OUT/vs_peer.txt" || status=1
exit $status
