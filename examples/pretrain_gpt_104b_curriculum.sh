#!/bin/bash
# The BigScience 104B curriculum-learning recipe (tr8b-104B, its "cl" run), scaled down to a toy model
# and launched by `deepspeed --num_gpus N`. Kept from the recipe: the optimizer block (Adam 0.9/0.95,
# cosine decay over tokens, sample-based warmup), the flag changes the curriculum asked for (no
# --rampup-batch-size; --lr-decay-tokens = decay samples x seq length; --train-samples set about twice
# what is needed, with --train-tokens as the real stop) and the curriculum_learning block (seqlen,
# fixed_linear from 64 tokens, difficulty_step 8). Scaled: 64 layers / 11600 hidden / 80 heads -> 2 / 64
# / 2, seq 2048 -> 256, global batch 2048 -> 8, total_curriculum_step 36000 -> 12.
#
# The sequence length of iteration t is min(256, 64 + 16 t): 80, 96, ..., 256 from iteration 12 on; the
# log line shows it as "curriculum seqlen", TensorBoard as curriculum_seqlen.
#
# Precision: the recipe runs fp16; DeepSpeed cannot run fp16 on CPU, so without a GPU the script uses
# --bf16 with a bf16 ds_config. Force either with PRECISION=fp16|bf16.
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
OUTPUT_DIR=${OUTPUT_DIR:-runs/104b_curriculum}
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

N_GPUS=${N_GPUS:-2}
MASTER_PORT=${MASTER_PORT:-29500}
TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-1}

MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=8

NLAYERS=2
NHIDDEN=64
NHEADS=2
SEQ_LEN=256

SAVE_INTERVAL=10

LR_WARMUP_SAMPLES=16
LR_DECAY_SAMPLES=100
LR_DECAY_TOKENS=$((LR_DECAY_SAMPLES * SEQ_LEN))

TRAIN_SAMPLES=400
TRAIN_TOKENS=20_000

OPTIMIZER_ARGS=" \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 6e-5 \
    --min-lr 6e-6 \
    --lr-warmup-samples $LR_WARMUP_SAMPLES \
    --lr-decay-tokens $LR_DECAY_TOKENS \
    --lr-decay-style cosine \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    "

EXIT_OPTS=" \
    --exit-duration-in-mins 1190 \
    "

GPT_ARGS=" \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples $TRAIN_SAMPLES \
    --train-tokens $TRAIN_TOKENS \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --$PRECISION \
    --checkpoint-activations \
    --no-masked-softmax-fusion \
    --seed 43 \
    $OPTIMIZER_ARGS \
    $EXIT_OPTS \
    "

OUTPUT_ARGS=" \
    --log-interval 1 \
    --save-interval $SAVE_INTERVAL \
    --eval-interval 1000 \
    --eval-iters 5 \
    --tensorboard-dir $TENSORBOARD_PATH \
    --tensorboard-queue-size 5 \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    "

ZERO_STAGE=1

config_json="$OUTPUT_DIR/ds_config.json"

cat <<EOT > "$config_json"
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  $PRECISION_JSON,
  "curriculum_learning": {
    "enabled": true,
    "curriculum_type": "seqlen",
    "min_difficulty": 64,
    "max_difficulty": $SEQ_LEN,
    "schedule_type": "fixed_linear",
    "schedule_config": {
      "total_curriculum_step": 12,
      "difficulty_step": 8
    }
  },
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

export LOGLEVEL=WARNING

CMD=" \
    deepspeed --num_gpus $N_GPUS --master_port $MASTER_PORT pretrain_gpt.py \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    $GPT_ARGS \
    $OUTPUT_ARGS \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --data-path $DATA_PATH \
    --split 949,50,1 \
    --distributed-backend nccl \
    $DEEPSPEED_ARGS \
    "

echo $CMD

$CMD
