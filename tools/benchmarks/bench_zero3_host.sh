#!/bin/bash
# The host's share of a ZeRO-3 step, on a CPU: a GPT of 24 tiny layers (hidden 64, seq 64) whose arithmetic
# costs next to nothing, so that the time per iteration is the trainer's and DeepSpeed's Python. One
# process (no collective waits), fp32, micro-batch 2, global batch 8 (4 micro-batches), 12 iterations;
# prints the mean milliseconds per iteration of iterations 5-12 at ZeRO-1 and at ZeRO-3, and their
# difference per micro-batch: what DeepSpeed's parameter fetch and release and its gradient hooks add.
# On a GPU the host runs ahead of the kernels only while that difference is under the micro-batch's GPU
# time (a 1.3B layer's is ~10 ms at micro-batch 8), so this bounds the model sizes ZeRO-3 keeps busy.
#   bash tools/benchmarks/bench_zero3_host.sh          (from the repository root; WORK=... keeps the data)
set -o pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/bench_zero3_host}
py=${PYTHON:-python3}
mkdir -p "$WORK"
if [ ! -f "$WORK/data/docs_text_document.idx" ]; then
    $py tools/train_tokenizer.py --input examples/data/python-docs.jsonl.gz --vocab-size 4000 \
        --output-dir "$WORK/tokenizer" > "$WORK/prepare.log" 2>&1 || exit 1
    $py tools/preprocess_data.py --input examples/data/python-docs.jsonl.gz --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$WORK/tokenizer/vocab.json" --merge-file "$WORK/tokenizer/merges.txt" --append-eod \
        --workers 1 --output-prefix "$WORK/data/docs" >> "$WORK/prepare.log" 2>&1 || exit 1
fi
declare -A mean
for stage in 1 3; do
    echo "{\"zero_optimization\": {\"stage\": $stage}, \"gradient_clipping\": 1.0}" > "$WORK/ds_zero$stage.json"
    torchrun --nproc_per_node 1 --master_port "${MASTER_PORT:-29533}" pretrain_gpt.py \
        --num-layers 24 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 12 --lr 1e-3 --log-interval 1 --eval-iters 0 \
        --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --split 98,1,1 \
        --data-path "$WORK/data/docs_text_document" --data-cache-path "$WORK/cache" \
        --vocab-file "$WORK/tokenizer/vocab.json" --merge-file "$WORK/tokenizer/merges.txt" \
        --distributed-backend gloo --deepspeed --deepspeed_config "$WORK/ds_zero$stage.json" \
        > "$WORK/zero$stage.log" 2>&1 || { echo "ZeRO-$stage run failed: $WORK/zero$stage.log"; exit 1; }
    mean[$stage]=$(grep -o "elapsed time per iteration (s): [0-9.]*" "$WORK/zero$stage.log" | tail -n +5 \
        | awk '{s += $6; n++} END {printf "%.1f", 1000 * s / n}')
    echo "ZeRO-$stage: ${mean[$stage]} ms per iteration"
done
awk -v a="${mean[3]}" -v b="${mean[1]}" 'BEGIN {printf "ZeRO-3 adds %.1f ms per micro-batch (24 layers)\n", (a - b) / 4}'
