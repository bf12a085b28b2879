#!/bin/bash
# 8-bit AdamW (--use-bnb-optimizer) against 32-bit AdamW on a 125M GPT (12 layers, hidden 768, 12 heads,
# seq 1024, vocabulary padded to 50304, bf16 at ZeRO-1, micro and global batch 8, lr 6e-4 cosine, 300
# iterations), same seed and data:
#   adam32        torch's AdamW; --embed-layernorm, so the architecture is the 8-bit run's (only the
#                 embedding's Xavier init differs); saves at 150
#   bnb8          bitsandbytes' AdamW8bit with the stable embedding; saves at 150
#   bnb8_resumed  resumes bnb8 from 150 and must continue its losses exactly
# then tests/gpu/bnb_adam_report.py: the loss curves, the optimizer state held by each (bytes of the
# state tensors in the iteration-150 checkpoint, and the peak memory line), the step time, the resume.
# Data: DATA_PREFIX, VOCAB_FILE, MERGE_FILE (default runs/bnb_gpu/, made from examples/data/python-docs.jsonl.gz
# by tools/train_tokenizer.py --vocab-size 16000 and tools/preprocess_data.py --append-eod; carry runs/bnb_gpu).
# bitsandbytes must be among the carried wheels (.whl/). Logs go to $OUT. EXTRA_FLAGS are added to every
# run; BASELINE=0 skips adam32; RESUME_RTOL is the largest relative difference allowed between the resumed
# and the uninterrupted losses (default 1e-4: GPU kernels are not bitwise reproducible; 0 with
# EXTRA_FLAGS=--deterministic). A dry run on CPU:
#   ITERS=20 NLAYERS=2 HIDDEN=64 HEADS=2 SEQ=128 bash tests/gpu/run_bnb_adam.sh
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_bnb}
WORK=${WORK:-/tmp/gpu_bnb_work}
DATA_PREFIX=${DATA_PREFIX:-runs/bnb_gpu/data/python-docs_text_document}
VOCAB_FILE=${VOCAB_FILE:-runs/bnb_gpu/tokenizer/vocab.json}
MERGE_FILE=${MERGE_FILE:-runs/bnb_gpu/tokenizer/merges.txt}
ITERS=${ITERS:-300}
SAVE_AT=$((ITERS / 2))
mkdir -p "$OUT" "$WORK"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" >> "$OUT/device.txt" 2>&1

run() {  # name [extra flags...]
    local name=$1
    shift
    deepspeed --num_gpus 1 --master_port 29512 pretrain_gpt.py \
        --num-layers "${NLAYERS:-12}" --hidden-size "${HIDDEN:-768}" --num-attention-heads "${HEADS:-12}" \
        --seq-length "${SEQ:-1024}" --max-position-embeddings "${SEQ:-1024}" --pad-vocab-size-to 50304 \
        --micro-batch-size 8 --global-batch-size 8 \
        --train-iters "$ITERS" --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters $((ITERS / 10)) --lr-decay-style cosine \
        --clip-grad 1.0 --weight-decay 0.1 --adam-beta2 0.95 --bf16 --zero-stage 1 --seed 1234 \
        --data-path "$DATA_PREFIX" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 100,0,0 \
        --num-workers 2 --log-interval 10 --eval-iters 0 --deepspeed ${EXTRA_FLAGS:-} "$@" > "$OUT/$name.log" 2>&1 \
        || status=1
}

if [ "${BASELINE:-1}" = 1 ]; then
    run adam32 --embed-layernorm --save "$WORK/adam32" --save-interval "$SAVE_AT"
fi
run bnb8 --use-bnb-optimizer --save "$WORK/bnb8" --save-interval "$SAVE_AT"
rm -rf "$WORK/resume" && mkdir -p "$WORK/resume" && cp -r "$WORK/bnb8/global_step$SAVE_AT" "$WORK/resume/" \
    && echo "global_step$SAVE_AT" > "$WORK/resume/latest"
run bnb8_resumed --use-bnb-optimizer --load "$WORK/resume" --save "$WORK/resume" --save-interval "$ITERS"
python3 tests/gpu/bnb_adam_report.py --logs "$OUT" --checkpoints "$WORK" --save-at "$SAVE_AT" \
    --resume-rtol "${RESUME_RTOL:-1e-4}" \
    | tee "$OUT/bnb_adam_report.txt" || status=1
exit $status
