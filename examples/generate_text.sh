#!/bin/bash
# Text from a training checkpoint: Megatron-DeepSpeed's examples/generate_text.sh (unconditional
# samples to a JSON-lines file, nucleus sampling), on the checkpoint of examples/quickstart.sh.
#
# The model's shape, its positions and its dtype are read from the checkpoint; only the tokenizer
# flags are needed besides --load. A checkpoint saved under TP x PP runs with TP x PP processes
# (NPROC; the launcher is torchrun), each rank reading only its own layers.
#
#   bash examples/generate_text.sh                       # 2 unconditional samples -> $GENFILE
#   PROMPTS=prompts.txt bash examples/generate_text.sh   # one prompt a line -> prompts.txt.out
#   INTERACTIVE=1 bash examples/generate_text.sh         # type prompts ("stop" ends)
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/quickstart}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$RUN_DIR/checkpoints}
VOCAB_FILE=${VOCAB_FILE:-$RUN_DIR/tokenizer/vocab.json}
MERGE_FILE=${MERGE_FILE:-$RUN_DIR/tokenizer/merges.txt}
GENFILE=${GENFILE:-$RUN_DIR/unconditional_samples.jsonl}
NPROC=${NPROC:-1}
OUT_SEQ_LENGTH=${OUT_SEQ_LENGTH:-64}

if [ -n "${PROMPTS:-}" ]; then
    mode=(--sample-input-file "$PROMPTS")
elif [ -n "${INTERACTIVE:-}" ]; then
    mode=()
else
    mode=(--num-samples "${NUM_SAMPLES:-2}" --genfile "$GENFILE")
fi

if [ "$NPROC" -gt 1 ]; then
    launch=(python3 -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1
            --master_port "${MASTER_PORT:-6001}")
else
    launch=(python3)
fi

"${launch[@]}" tools/generate_samples_gpt.py \
    --load "$CHECKPOINT_PATH" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --micro-batch-size 2 --out-seq-length "$OUT_SEQ_LENGTH" \
    --temperature 1.0 --top_p 0.9 --seed "${SEED:-1234}" \
    "${mode[@]}" "$@"
