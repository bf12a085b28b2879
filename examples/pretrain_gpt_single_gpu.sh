#!/bin/bash
# One GPU, one process, no launcher: Megatron-DeepSpeed's examples/pretrain_gpt.sh (GPT-2 345M, cosine decay,
# 1 % warmup) on the DeepSpeed engine with a ds_config template.
#
# `python pretrain_gpt.py` alone is rank 0 of a world of 1. When MASTER_ADDR, MASTER_PORT, RANK,
# LOCAL_RANK and WORLD_SIZE are in the environment (Megatron-DeepSpeed's "emulate distributed" recipe:
# MASTER_ADDR=localhost MASTER_PORT=9994 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1), they are used.
#
# Precision: fp16 (examples/ds_config_fp16.json) on a GPU; DeepSpeed cannot run fp16 on CPU, so
# without a GPU bf16 (examples/ds_config_bf16.json). Force either with PRECISION=fp16|bf16.
# Every size below can be overridden from the environment (NLAYERS=2 NHIDDEN=64 ... for a smoke run).
# Inputs default to the outputs of examples/quickstart.sh (RUN_DIR, DATA_PATH, VOCAB_FILE, MERGE_FILE).
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/quickstart}
VOCAB_FILE=${VOCAB_FILE:-$RUN_DIR/tokenizer/vocab.json}
MERGE_FILE=${MERGE_FILE:-$RUN_DIR/tokenizer/merges.txt}
DATA_PATH=${DATA_PATH:-$RUN_DIR/data/python-docs_text_document}
OUTPUT_DIR=${OUTPUT_DIR:-runs/single_gpu}
CHECKPOINT_PATH=$OUTPUT_DIR/checkpoints
TENSORBOARD_PATH=$OUTPUT_DIR/tensorboard

if [ -z "${PRECISION:-}" ]; then
    if python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        PRECISION=fp16
    else
        PRECISION=bf16
    fi
fi
case $PRECISION in
    fp16|bf16) ;;
    *) echo "PRECISION must be fp16 or bf16, got '$PRECISION'" >&2; exit 2 ;;
esac
echo "precision: $PRECISION (examples/ds_config_$PRECISION.json)"

NLAYERS=${NLAYERS:-24}
NHIDDEN=${NHIDDEN:-1024}
NHEADS=${NHEADS:-16}
SEQ_LEN=${SEQ_LEN:-1024}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-320000}
LOG_INTERVAL=${LOG_INTERVAL:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-10}

GPT_ARGS=" \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --lr 0.00015 \
    --train-iters $TRAIN_ITERS \
    --lr-decay-iters $LR_DECAY_ITERS \
    --lr-decay-style cosine \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --lr-warmup-fraction .01 \
    --$PRECISION \
    "

OUTPUT_ARGS=" \
    --log-interval $LOG_INTERVAL \
    --save-interval $SAVE_INTERVAL \
    --eval-interval $EVAL_INTERVAL \
    --eval-iters $EVAL_ITERS \
    --checkpoint-activations \
    --tensorboard-dir $TENSORBOARD_PATH \
    "

DATA_ARGS=" \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --data-path $DATA_PATH \
    "

DEEPSPEED_ARGS=" \
    --deepspeed \
    --deepspeed_config examples/ds_config_$PRECISION.json \
    "

python3 pretrain_gpt.py $GPT_ARGS $OUTPUT_ARGS $DATA_ARGS $DEEPSPEED_ARGS
