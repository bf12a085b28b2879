#!/bin/bash
# The README's main job, on the embedded sample corpus (Python's documentation, PSF license):
#   1. train a byte-level BPE tokenizer on it          (tools/train_tokenizer.py)
#   2. preprocess it into an mmap .bin/.idx dataset    (tools/preprocess_data.py, 2 workers)
#   3. pretrain a small GPT on it with 2 processes     (pretrain_gpt.py under torchrun)
#      4 layers, hidden 256, 8 heads, sequence 256, 8192-token vocabulary (5.3M parameters),
#      global batch 16, TRAIN_ITERS iterations (default 120): data parallel with ZeRO-1, an
#      evaluation and a checkpoint every 40 iterations, TensorBoard.
#      Without a GPU: 2 CPU processes in fp32 over gloo (about 1.2 s per iteration on 2 cores).
#      With GPUs: one process per GPU (at most 2) in bf16 (fp16 where bf16 is missing) over NCCL.
# and print where everything is. Outputs go to $RUN_DIR (default runs/quickstart); running it again
# resumes from the checkpoints there (delete $RUN_DIR/checkpoints to start over), with a new log file
# (logs/pretrain_<date-time>.log): earlier logs are kept.
# Set SKIP_INSTALL=1 to use the current environment as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash tools/install.sh
py=${PYTHON:-python3}
run_dir=${RUN_DIR:-runs/quickstart}
train_iters=${TRAIN_ITERS:-120}
corpus=examples/data/python-docs.jsonl.gz
mkdir -p "$run_dir/data" "$run_dir/logs"
start=$(date +%s)
log_file="$run_dir/logs/pretrain_$(date +%Y%m%d-%H%M%S).log"

echo "== 1. tokenizer: byte-level BPE, 8192 tokens, trained on $corpus"
$py tools/train_tokenizer.py --input "$corpus" --vocab-size 8192 --output-dir "$run_dir/tokenizer"

echo "== 2. preprocessing: jsonl -> $run_dir/data/python-docs_text_document.{bin,idx}"
$py tools/preprocess_data.py --input "$corpus" --json-keys text \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$run_dir/tokenizer/vocab.json" --merge-file "$run_dir/tokenizer/merges.txt" \
    --append-eod --workers 2 --output-prefix "$run_dir/data/python-docs"

read -r gpus precision < <($py -c "
import torch
n = torch.cuda.device_count()
print(n, ('--bf16' if torch.cuda.is_bf16_supported() else '--fp16') if n else 'fp32')")
if [ "$gpus" -gt 0 ]; then
    nproc=$(( gpus < 2 ? gpus : 2 ))
    device="$nproc GPU process(es), ${precision#--}"
    precision_flags=("$precision")
else
    nproc=2
    cores=$($py -c "import os; print(len(os.sched_getaffinity(0)))")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores > nproc ? cores / nproc : 1 ))}
    device="$nproc CPU processes, fp32, $OMP_NUM_THREADS thread(s) each"
    precision_flags=()
fi
if [ -f "$run_dir/checkpoints/latest" ]; then
    echo "   (resuming from the checkpoints in $run_dir/checkpoints; delete them to start over)"
fi

echo "== 3. pretraining: GPT 4 x 256, seq 256, $train_iters iterations of 16 samples on $device"
$py -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
    --master_port "${MASTER_PORT:-29500}" pretrain_gpt.py \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 \
    --seq-length 256 --max-position-embeddings 256 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$train_iters" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.08 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --zero-stage 1 ${precision_flags[@]+"${precision_flags[@]}"} \
    --data-path "$run_dir/data/python-docs_text_document" --split 949,50,1 \
    --vocab-file "$run_dir/tokenizer/vocab.json" --merge-file "$run_dir/tokenizer/merges.txt" \
    --num-workers 1 --valid-num-workers 0 \
    --log-interval 10 --eval-interval 40 --eval-iters 5 \
    --save "$run_dir/checkpoints" --load "$run_dir/checkpoints" --save-interval 40 \
    --tensorboard-dir "$run_dir/tensorboard" --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard \
    --log-path "$run_dir/logs" 2>&1 | tee "$log_file"

echo "== done in $(( $(date +%s) - start )) s; everything is under $run_dir:"
echo "   tokenizer     $run_dir/tokenizer/{vocab.json,merges.txt}"
echo "   dataset       $run_dir/data/python-docs_text_document.{bin,idx} (+ index caches)"
echo "   checkpoints   $run_dir/checkpoints (latest: $(cat "$run_dir/checkpoints/latest"))"
echo "   tensorboard   $run_dir/tensorboard   ->  tensorboard --logdir $run_dir/tensorboard"
echo "   training log  $log_file (arguments and layers: $run_dir/logs/{args,model}_*.txt)"
plot_command="$py tools/plot_logs.py $run_dir/tensorboard --out $run_dir/plots"
if $py -c "import matplotlib" >/dev/null 2>&1; then
    echo "   plots         $plot_command"
else
    echo "   plots         $plot_command  (first: pip install 'matplotlib>=3.7')"
fi
grep "training summary" "$log_file" | sed 's/^/   /'
