#!/bin/bash
# Megatron-DeepSpeed's single-node example ("Deepspeed PP and ZeRO-DP" in its README): the same
# GPT_ARGS / OUTPUT_ARGS / DATA_ARGS / DEEPSPEED_ARGS blocks and the same inline ds_config, on a
# 2-layer, 64-wide model, launched by `deepspeed --num_gpus N`.
#
# Precision: Megatron-DeepSpeed's example runs fp16 (dynamic loss scaling). DeepSpeed cannot run fp16 on CPU, so without
# a GPU the script switches to --bf16 with a bf16 ds_config (same batch, clipping and ZeRO stage).
# Force either with PRECISION=fp16|bf16.
#
# Inputs (defaults: the outputs of examples/quickstart.sh):
#   DATA_PATH, VOCAB_FILE, MERGE_FILE   preprocessed data prefix and GPT-2 BPE files
#   OUTPUT_DIR                          checkpoints, TensorBoard and the ds_config go here
#   N_GPUS                              processes (GPUs, or CPU processes without a GPU); default 2
#   MASTER_PORT                         rendezvous port of the launcher; default 29500
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/quickstart}
VOCAB_FILE=${VOCAB_FILE:-$RUN_DIR/tokenizer/vocab.json}
MERGE_FILE=${MERGE_FILE:-$RUN_DIR/tokenizer/merges.txt}
DATA_PATH=${DATA_PATH:-$RUN_DIR/data/python-docs_text_document}
OUTPUT_DIR=${OUTPUT_DIR:-runs/single_node}
CHECKPOINT_PATH=$OUTPUT_DIR/checkpoints
TENSORBOARD_PATH=$OUTPUT_DIR/tensorboard
mkdir -p "$OUTPUT_DIR"

if [ -z "${PRECISION:-}" ]; then
    if python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        PRECISION=fp16
    else
        PRECISION=bf16
    fi
fi
case $PRECISION in
    fp16) PRECISION_JSON='"fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 12
  }' ;;
    bf16) PRECISION_JSON='"bf16": {
    "enabled": true
  }' ;;
    *) echo "PRECISION must be fp16 or bf16, got '$PRECISION'" >&2; exit 2 ;;
esac
echo "precision: $PRECISION"

MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=16
TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-1}

N_GPUS=${N_GPUS:-2}
MASTER_PORT=${MASTER_PORT:-29500}
SAVE_INTERVAL=100

GPT_ARGS=" \
    --num-layers 2 \
    --hidden-size 64 \
    --num-attention-heads 2 \
    --seq-length 1024 \
    --max-position-embeddings 1024 \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --rampup-batch-size 2 2 1_000 \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples 100 \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 1e-4 \
    --lr-warmup-samples 5 \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --$PRECISION \
    "

OUTPUT_ARGS=" \
    --log-interval 10 \
    --save-interval $SAVE_INTERVAL \
    --eval-interval 100 \
    --eval-iters 10 \
    --checkpoint-activations \
    "

DATA_ARGS=" \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --data-path $DATA_PATH \
    --tensorboard-dir $TENSORBOARD_PATH \
    --tensorboard-queue-size 5 \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    "

ZERO_STAGE=1

config_json="$OUTPUT_DIR/ds_config.json"

# DeepSpeed derives the gradient accumulation steps from the ramped-up global batch
# (engine.set_train_batch_size every iteration).
cat <<EOT > "$config_json"
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  $PRECISION_JSON,
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT

DEEPSPEED_ARGS=" \
    --deepspeed \
    --deepspeed_config ${config_json} \
    --zero-stage ${ZERO_STAGE} \
    --deepspeed-activation-checkpointing \
    "

ALL_ARGS="$GPT_ARGS $OUTPUT_ARGS $DATA_ARGS $DEEPSPEED_ARGS"

# quiet the launcher's per-process banners
export LOGLEVEL=WARNING

LAUNCHER="deepspeed --num_gpus $N_GPUS --master_port $MASTER_PORT"
CMD=" \
    $LAUNCHER pretrain_gpt.py \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    --distributed-backend nccl \
    $ALL_ARGS \
    "

echo $CMD

$CMD
