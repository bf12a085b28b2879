#!/bin/bash
# Several nodes through torchrun's static rendezvous: run this script once on every node, with the
# same MASTER_ADDR (a host every node can reach, usually node 0) and MASTER_PORT, and NODE_RANK
# 0 .. NNODES-1. Each node starts GPUS_PER_NODE processes; ranks are node_rank x GPUS_PER_NODE + local.
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_gpt_multinode_torchrun.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/pretrain_gpt_multinode_torchrun.sh
#
# Defaults: a 1.3B GPT (24 layers, h 2048, 16 heads, seq 2048) in bf16 with ZeRO-1
# (examples/ds_config_bf16.json), TP 2 x PP 2 within the job; DP = world / (TP x PP). Every
# value below can be overridden from the environment. Data defaults to examples/quickstart.sh's
# outputs (RUN_DIR, DATA_PATH, VOCAB_FILE, MERGE_FILE), which every node must see at that path.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:?set NODE_RANK to the index of this node, 0 .. NNODES-1}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the host of node 0}
MASTER_PORT=${MASTER_PORT:-6000}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

RUN_DIR=${RUN_DIR:-runs/quickstart}
VOCAB_FILE=${VOCAB_FILE:-$RUN_DIR/tokenizer/vocab.json}
MERGE_FILE=${MERGE_FILE:-$RUN_DIR/tokenizer/merges.txt}
DATA_PATH=${DATA_PATH:-$RUN_DIR/data/python-docs_text_document}
OUTPUT_DIR=${OUTPUT_DIR:-runs/multinode}
DS_CONFIG=${DS_CONFIG:-examples/ds_config_bf16.json}
PRECISION_FLAG=${PRECISION_FLAG:---bf16}

TP_SIZE=${TP_SIZE:-2}
PP_SIZE=${PP_SIZE:-2}
NLAYERS=${NLAYERS:-24}
NHIDDEN=${NHIDDEN:-2048}
NHEADS=${NHEADS:-16}
SEQ_LEN=${SEQ_LEN:-2048}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-512}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-10_000_000}
LR_WARMUP_SAMPLES=${LR_WARMUP_SAMPLES:-100_000}
LOG_INTERVAL=${LOG_INTERVAL:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}

GPT_ARGS=" \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples $TRAIN_SAMPLES \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 2e-4 \
    --min-lr 2e-5 \
    --lr-decay-style cosine \
    --lr-warmup-samples $LR_WARMUP_SAMPLES \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    $PRECISION_FLAG \
    "

OUTPUT_ARGS=" \
    --log-interval $LOG_INTERVAL \
    --save-interval $SAVE_INTERVAL \
    --eval-interval $EVAL_INTERVAL \
    --eval-iters $EVAL_ITERS \
    --tensorboard-dir $OUTPUT_DIR/tensorboard \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    "

DATA_ARGS=" \
    --save $OUTPUT_DIR/checkpoints \
    --load $OUTPUT_DIR/checkpoints \
    --data-path $DATA_PATH \
    --split 949,50,1 \
    "

DEEPSPEED_ARGS=" \
    --deepspeed \
    --deepspeed_config $DS_CONFIG \
    "

LAUNCHER="torchrun \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --nproc_per_node $GPUS_PER_NODE \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT \
    "

$LAUNCHER pretrain_gpt.py $GPT_ARGS $OUTPUT_ARGS $DATA_ARGS $DEEPSPEED_ARGS --distributed-backend nccl
